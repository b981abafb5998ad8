"""The decode graphs' samplers (flared/model/kernels/sampling.py): the race over the whole vocabulary with no sort
(the TEMPERATURE graphs), and the full sampler's min-p/top-k/top-p masks over the same race (found by the walk up
the ranking, no sort), so a row draws the same token in either; and the executor picking the TEMPERATURE graphs for
steps whose drawing rows have no min-p, top-k or top-p."""

import array
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))

from flared_testing.race import reference_race as _reference_race  # noqa: E402


@pytest.mark.parametrize("batch, vocab", [(1, 49152), (5, 1000), (64, 128256)])
def test_the_race_draws_the_reference_s_token(batch, vocab):
    """Each row's token is the float64 race's (ties between scores are improbable at these sizes), greedy rows'
    the argmax; rows spread over several programs agree with one."""
    from flared.model.kernels.sampling import sample_race

    g = torch.Generator(device="cuda").manual_seed(batch)
    logits = torch.randn(batch, vocab, device="cuda", generator=g) * 4
    temperature = torch.tensor([0.0 if i % 4 == 3 else 0.3 + 0.2 * i for i in range(batch)], device="cuda")
    seeds = torch.arange(batch, device="cuda", dtype=torch.int64) * 7919 + (1 << 40)
    steps = torch.arange(batch, device="cuda", dtype=torch.int64) * 3
    got = sample_race(logits, temperature, seeds, steps)
    assert torch.equal(got, _reference_race(logits, temperature, seeds, steps))


@pytest.mark.parametrize("full", [False, True])
def test_a_token_holding_nearly_all_the_mass_is_always_drawn(full):
    """Every other token of these rows has probability e^-40 (5e-13 together): in 2,560 draws none may win. The
    noise's u rounds to 1 for 64 of the 2^31 hashes; -log(u) = 0 then scored that token +inf, and it won whatever
    its probability (about one row-step in 260 at 128,256 tokens): E now stops at 2^-24."""
    from flared.model.kernels.sampling import sample_full, sample_race

    rows, vocab = 256, 128256
    logits = torch.full((rows, vocab), -40.0, device="cuda")
    logits[:, 7] = 0.0
    temperature = torch.ones(rows, device="cuda")
    seeds = torch.arange(rows, device="cuda", dtype=torch.int64) * 7919 + 11
    for step in range(10):
        steps = torch.full((rows,), step, dtype=torch.int64, device="cuda")
        if full:  # the FULL graphs' race (no masks: a mask would reject such a winner and walk on)
            got = sample_full(logits, temperature, torch.zeros(rows, dtype=torch.int32, device="cuda"),
                              torch.ones(rows, device="cuda"), seeds, steps)
        else:
            got = sample_race(logits, temperature, seeds, steps)
        assert bool((got == 7).all()), (step, got[got != 7].tolist())


def test_the_race_follows_the_distribution():
    """Over 4,000 steps of one row the draws' frequencies match softmax(x / T) (within 4 standard errors); a
    masked (-inf) token is never drawn."""
    from flared.model.kernels.sampling import sample_race

    n = 4000
    x = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")], device="cuda")
    t = 0.8
    draws = sample_race(x.expand(n, -1).contiguous(), torch.full((n,), t, device="cuda"),
                        torch.full((n,), 12345, dtype=torch.int64, device="cuda"),
                        torch.arange(n, dtype=torch.int64, device="cuda"))
    counts = torch.bincount(draws, minlength=6).double().cpu() / n
    p = torch.softmax(x / t, dim=0).double().cpu()
    assert counts[5] == 0
    for i in range(5):
        assert abs(counts[i] - p[i]) < 4 * math.sqrt(p[i] * (1 - p[i]) / n), (i, counts, p)


def test_the_full_sampler_keeps_its_masks_and_draws_as_the_race():
    """sample_full: a row with top-k draws among its k likeliest, a row with top-p among its nucleus; a row with
    neither draws what sample_race draws for it (the TEMPERATURE graphs), so its tokens do not depend on the graph
    its step took."""
    from flared.model.kernels.sampling import sample_full, sample_race

    n, vocab = 256, 4096
    g = torch.Generator(device="cuda").manual_seed(3)
    row = torch.randn(vocab, device="cuda", generator=g) * 3
    logits = row.expand(n, -1).contiguous()
    seeds = torch.full((n,), 99, dtype=torch.int64, device="cuda")
    steps = torch.arange(n, dtype=torch.int64, device="cuda")
    temperature = torch.full((n,), 1.0, device="cuda")
    top_k = torch.tensor([5 if i % 3 == 0 else 0 for i in range(n)], dtype=torch.int32, device="cuda")
    top_p = torch.tensor([0.5 if i % 3 == 1 else 1.0 for i in range(n)], device="cuda")
    got = sample_full(logits, temperature, top_k, top_p, seeds, steps).cpu()
    order = row.argsort(descending=True).cpu()
    probs = torch.softmax(row.double(), dim=0).cpu()
    nucleus = set(order[:int((probs[order].cumsum(0) - probs[order] < 0.5).sum())].tolist())
    top5 = set(order[:5].tolist())
    race = sample_race(logits, temperature, seeds, steps).cpu()
    for i in range(n):
        if i % 3 == 0:
            assert int(got[i]) in top5
        elif i % 3 == 1:
            assert int(got[i]) in nucleus
        else:
            assert got[i] == race[i]
    assert len({int(got[i]) for i in range(2, n, 3)}) > 10  # the plain rows draw widely


def _reference_masked_race(logits, temperature, top_k, top_p, seeds, steps, min_p_log=None, chain=None):
    """Min-p/top-k/top-p by a stable sort in float64 (rank: larger logit first, smaller id first among equal ones),
    then the float64 race over the kept tokens; the argmax at temperature 0. Min-p (``min_p_log``, the kernel's
    threshold: kept iff x / T >= max x / T + min_p_log, judged in float32 as the kernel does). vLLM's order: min-p
    and top-k first, top-p on shares of what both kept, at temperature T. ``chain`` 1 (llama.cpp's default chain):
    top-k, then top-p on shares of the k at temperature 1, then min-p."""
    batch, vocab = logits.shape
    masked = torch.full_like(logits, float("-inf"), dtype=torch.float64)
    for r in range(batch):
        x = logits[r].double()
        order = torch.sort(x, descending=True, stable=True).indices
        t = max(float(temperature[r]), 1e-5)
        chained = chain is not None and int(chain[r]) != 0
        probs = torch.softmax(x / (1.0 if chained else t), 0)[order]
        kept_by_min_p = torch.ones(vocab, dtype=torch.bool, device=x.device)
        if min_p_log is not None and float(min_p_log[r]) > float("-inf"):
            scaled = logits[r].float() * (1.0 / temperature[r:r + 1].float())
            kept_by_min_p = (scaled >= scaled.max() + min_p_log[r].float())[order]
        k = int(top_k[r]) if int(top_k[r]) > 0 else vocab
        in_k = torch.arange(vocab, device=x.device) < k
        probs = probs / probs[in_k if chained else in_k & kept_by_min_p].sum()
        keep = kept_by_min_p & in_k & (probs.cumsum(0) - probs < float(top_p[r]))
        masked[r, order[keep]] = x[order[keep]]
    return _reference_race(masked, temperature, seeds, steps).where(temperature > 0, logits.argmax(dim=-1))


@pytest.mark.parametrize("batch, vocab, spread", [(24, 3000, 2.0), (8, 49152, 0.5), (64, 128256, 3.0)])
def test_the_walk_draws_the_masked_race_s_token(batch, vocab, spread):
    """sample_full's token for every row is the float64 race's over the row's top-k/top-p tokens, at several steps:
    logits rounded to bf16 (many equal logits: ranks among them by id), a row of equal logits, top-k 1 to 1,000
    (beside a top-p: the select on the logits above the race's lane maxima, or over the whole row where k is more
    than those hold, 100 and 1,000 at 64 rows, or too many logits tie), top-p 0.01 to 1, greedy rows, rows with
    masked (-inf) tokens; the walk's passes are reported, 0 for rows without masks."""
    from flared.model.kernels.sampling import sample_full

    g = torch.Generator(device="cuda").manual_seed(vocab)
    logits = (torch.randn(batch, vocab, device="cuda", generator=g) * spread).bfloat16().float()
    logits[1, ::3] = float("-inf")
    logits[3] = 0.5  # every logit equal: the k are the first k ids (top-k 5, top-p 0.9)
    ks = [0, 1, 2, 5, 40, 1000, 100]
    ps = [1.0, 0.01, 0.3, 0.9, 0.95]
    top_k = torch.tensor([ks[i % len(ks)] for i in range(batch)], dtype=torch.int32, device="cuda")
    top_p = torch.tensor([ps[i % len(ps)] for i in range(batch)], device="cuda")
    temperature = torch.tensor([0.0 if i % 7 == 6 else 0.4 + 0.1 * (i % 9) for i in range(batch)], device="cuda")
    seeds = torch.arange(batch, device="cuda", dtype=torch.int64) * 104729 + (3 << 33)
    for step in range(3):
        steps = torch.full((batch,), step * 17, dtype=torch.int64, device="cuda")
        passes = torch.full((batch,), -1, dtype=torch.int32, device="cuda")
        got = sample_full(logits, temperature, top_k, top_p, seeds, steps, passes)
        want = _reference_masked_race(logits, temperature, top_k, top_p, seeds, steps)
        assert torch.equal(got, want), (step, (got != want).nonzero().flatten().tolist())
        walks = (temperature > 0) & ((top_k > 0) | (top_p < 1))
        assert bool((passes[~walks] == 0).all()) and bool((passes[walks] >= 1).all()), passes.tolist()


@pytest.mark.parametrize("batch, vocab, spread", [(24, 3000, 2.0), (8, 49152, 0.5), (64, 128256, 3.0)])
@pytest.mark.parametrize("chained", [False, True])
def test_the_walk_draws_the_masked_race_s_token_with_min_p(batch, vocab, spread, chained):
    """With min-p beside top-k and top-p, and rows without it: every row's token is the float64 reference's; a row
    with min-p alone walks; min-p 1 keeps only the row's largest logits. vLLM's order (min-p first, top-p then
    judging shares of what min-p and top-k kept) and, ``chained``, every other row in llama.cpp's chain (top-p on
    shares of the k at temperature 1, min-p after it)."""
    from flared.model.kernels import min_p_log_threshold
    from flared.model.kernels.sampling import sample_full

    g = torch.Generator(device="cuda").manual_seed(vocab + 1)
    logits = (torch.randn(batch, vocab, device="cuda", generator=g) * spread).bfloat16().float()
    logits[2, ::5] = float("-inf")
    ks = [0, 0, 5, 40, 1000]
    ps = [1.0, 0.9, 1.0, 0.95, 0.3, 0.99]
    mps = [0.05, 0.0, 0.2, 1e-4, 0.6, 1.0, 0.01]
    top_k = torch.tensor([ks[i % len(ks)] for i in range(batch)], dtype=torch.int32, device="cuda")
    top_p = torch.tensor([ps[i % len(ps)] for i in range(batch)], device="cuda")
    temperature = torch.tensor([0.0 if i % 8 == 7 else 0.5 + 0.15 * (i % 6) for i in range(batch)], device="cuda")
    chain = torch.tensor([int(chained and i % 2 == 1) for i in range(batch)], dtype=torch.int32, device="cuda")
    min_p_log = torch.tensor([min_p_log_threshold(mps[i % len(mps)], float(temperature[i]), bool(chain[i]))
                              for i in range(batch)], device="cuda")
    seeds = torch.arange(batch, device="cuda", dtype=torch.int64) * 7727 + (5 << 35)
    for step in range(3):
        steps = torch.full((batch,), step * 29 + 1, dtype=torch.int64, device="cuda")
        passes = torch.full((batch,), -1, dtype=torch.int32, device="cuda")
        got = sample_full(logits, temperature, top_k, top_p, seeds, steps, passes, min_p_log=min_p_log,
                          chain=chain if chained else None)
        want = _reference_masked_race(logits, temperature, top_k, top_p, seeds, steps, min_p_log, chain)
        assert torch.equal(got, want), (step, (got != want).nonzero().flatten().tolist())
        walks = (temperature > 0) & ((top_k > 0) | (top_p < 1) | (min_p_log > float("-inf")))
        assert bool((passes[~walks] == 0).all()) and bool((passes[walks] >= 1).all()), passes.tolist()
        for i in range(batch):
            if mps[i % len(mps)] == 1.0 and float(temperature[i]) > 0:
                assert float(logits[i, got[i]]) == float(logits[i].max())


@pytest.mark.parametrize("vocab", [3000, 49152])
def test_top_k_and_top_p_draw_the_cpu_sampler_s_token(vocab):
    """Top-p judges shares of the k tokens (renormalised, as the CPU Sampler, vLLM and llama.cpp do), in vLLM's
    order and in llama.cpp's chain (at temperature 1, min-p after top-p): on rows where the k hold little of the
    mass, with min-p on some, every row's token equals the CPU Sampler's (the same race noise) at each step;
    not renormalising would keep more of the k on these rows."""
    from flared.model.kernels import min_p_log_threshold
    from flared.model.kernels.sampling import sample_full
    from flared.model.sampling import LLAMA_CPP_ORDER, Sampler, SamplingParams

    rows = 12
    g = torch.Generator(device="cuda").manual_seed(vocab + 7)
    # Flat (the k hold little of the mass) and float32: no equal logits, which the CPU Sampler's topk may rank
    # otherwise than by id
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 0.7
    params = []
    for i in range(rows):
        order = LLAMA_CPP_ORDER if i % 2 else ()
        params.append(SamplingParams(temperature=[0.7, 1.0, 1.6][i % 3], top_k=[40, 200, 7][i % 3],
                                     top_p=[0.5, 0.9, 0.3, 0.95][i % 4], min_p=0.6 if i % 4 == 3 else 0.0,
                                     seed=1000 + i, sampler_order=order))
    cpu = Sampler(vocab, device="cpu")
    states = [cpu.add_sequence(p, []) for p in params]
    dev = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=dev)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int32, device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    min_p_log = torch.tensor([min_p_log_threshold(p.min_p, p.temperature, bool(p.sampler_order)) for p in params],
                             device=dev)
    chain = torch.tensor([int(bool(p.sampler_order)) for p in params], dtype=torch.int32, device=dev)
    seeds = torch.tensor([s.seed for s in states], dtype=torch.int64, device=dev)
    for step in range(4):
        steps = torch.full((rows,), step, dtype=torch.int64, device=dev)
        got = sample_full(logits, temperature, top_k, top_p, seeds, steps, min_p_log=min_p_log, chain=chain)
        want = cpu.sample(logits.cpu(), states).token_ids
        assert got.cpu().tolist() == want.tolist(), step
    # The old rule (top-p on shares of the whole row) keeps every one of a flat row's k here: the cases differ.
    plain = _reference_masked_race(logits, temperature, top_k, torch.ones_like(top_p), seeds, steps)
    assert sum(int(a != b) for a, b in zip(got.tolist(), plain.tolist())) > 0


def test_the_walk_keeps_only_the_top_token_at_top_k_1():
    """Top-k 1 is the argmax at any temperature; a row whose logits are all equal takes its first id."""
    from flared.model.kernels.sampling import sample_full

    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(32, 49152, device="cuda", generator=g) * 0.2
    logits[5] = 1.0
    n = logits.shape[0]
    got = sample_full(logits, torch.full((n,), 2.0, device="cuda"), torch.ones(n, dtype=torch.int32, device="cuda"),
                      torch.ones(n, device="cuda"), torch.arange(n, dtype=torch.int64, device="cuda"),
                      torch.arange(n, dtype=torch.int64, device="cuda"))
    assert torch.equal(got, logits.argmax(dim=-1)) and int(got[5]) == 0


@pytest.mark.parametrize("full", [False, True])
def test_rows_naming_a_slot_are_shaped_as_the_sampler_shapes_them(full):
    """Rows naming a Sampler slot (logit bias; repetition over the prompt and output; frequency and presence over
    the output; allowed ids and bad words of one token, as -inf in the bias row) draw the tokens the unshaped
    kernels draw from the torch Sampler's shaped logits, greedy rows too; their shaped rows are left in the logits
    and the drawn tokens counted in their slots. A row naming no slot is read as it is and counts nothing."""
    from flared.model.kernels.sampling import sample_full, sample_race
    from flared.model.sampling import Sampler, SamplingParams

    vocab, dev = 3000, torch.device("cuda")
    sampler = Sampler(vocab, device=dev, max_penalty_slots=8, graph_tables=True)
    params = [SamplingParams(temperature=0.9, repetition_penalty=1.6, frequency_penalty=0.4, presence_penalty=0.8),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=1.0),
              SamplingParams(temperature=1.1, logit_bias={5: 3.0, 7: -100.0, 2999: 0.25}),
              SamplingParams(temperature=0.7),  # no slot
              SamplingParams(temperature=0.5, frequency_penalty=-0.5, logit_bias={11: 1.5}),
              SamplingParams(temperature=0.0, logit_bias={42: 1e4}),  # greedy, forced by its bias
              SamplingParams(temperature=0.8, allowed_token_ids=(3, 4, 5, 17, 2000), logit_bias={4: 1.0}),
              SamplingParams(temperature=0.0, bad_words=((9,), (12,)), repetition_penalty=1.2),  # greedy, 9 banned
              # greedy, 42 its argmax but banned for its first 3 tokens
              SamplingParams(temperature=0.0, min_tokens=3, min_tokens_banned=frozenset({42, 77}), max_tokens=8)]
    g = torch.Generator(device="cuda").manual_seed(7)
    prompts = [torch.randint(0, vocab, (50,), generator=g, device=dev).tolist() for _ in params]
    states = [sampler.add_sequence(p, prompt) for p, prompt in zip(params, prompts)]
    for s in states:  # earlier output: counts of up to three
        if s.penalty_slot is not None:
            drawn = torch.randint(0, 200, (60,), generator=g, device=dev)
            sampler.output_counts[s.penalty_slot].index_add_(0, drawn, torch.ones_like(drawn, dtype=torch.int32))
    assert [s.graph_shaped for s in states] == [True, True, True, False, True, True, True, True, True]
    batch = len(states)
    logits = torch.randn(batch, vocab, device=dev, generator=g) * 3
    logits[7, 9] = 50.0  # the argmax, but banned
    logits[8, 42] = 60.0
    slots = torch.tensor([-1 if s.penalty_slot is None else s.penalty_slot for s in states], dtype=torch.int32,
                         device=dev)
    temperature = torch.tensor([p.temperature for p in params], device=dev)
    seeds = torch.arange(batch, dtype=torch.int64, device=dev) * 7919 + 3
    counts_before = sampler.output_counts.clone()
    for step in range(6):
        for s in states:  # min_tokens' bans hold while fewer are drawn
            s.num_output_tokens = step
        shaped = sampler.apply_bias_and_penalties(logits, states)
        steps = torch.full((batch,), step, dtype=torch.int64, device=dev)
        buffer = logits.clone()
        if full:
            top_k = torch.tensor([0, 0, 40, 0, 0, 0, 3, 0, 0], dtype=torch.int32, device=dev)
            top_p = torch.tensor([0.9, 1.0, 0.95, 0.8, 1.0, 1.0, 0.9, 1.0, 1.0], device=dev)
            want = sample_full(shaped.clone(), temperature, top_k, top_p, seeds, steps)
            counts = sampler.output_counts.clone()
            got = sample_full(buffer, temperature, top_k, top_p, seeds, steps,
                              shape=(slots, sampler.shape_tables()))
        else:
            want = sample_race(shaped.clone(), temperature, seeds, steps)
            counts = sampler.output_counts.clone()
            got = sample_race(buffer, temperature, seeds, steps, shape=(slots, sampler.shape_tables()))
        assert torch.equal(got, want), step
        assert torch.allclose(buffer, shaped, rtol=1e-6, atol=1e-5)
        assert torch.equal(buffer[3], logits[3])
        for i, s in enumerate(states):
            if s.penalty_slot is not None:
                counts[s.penalty_slot, int(got[i])] += 1
        assert torch.equal(sampler.output_counts, counts), step
        sampler.output_counts.copy_(counts_before)  # each step draws from the same shaped rows
        assert (int(got[8]) == 42) is (step >= 3), step
    assert int(got[5]) == 42 and int(got[6]) in (3, 4, 5, 17, 2000) and int(got[7]) not in (9, 12)


def _grammar_states(sampler, params, grammared, g, vocab):
    """A state per params, from a random 20-token prompt; those ``grammared`` under a grammar (an AheadMask that
    allows nothing until _give_masks gives it one)."""
    from flared.model.grammar import AheadMask

    words = (vocab + 31) // 32
    states = []
    for p, has in zip(params, grammared):
        prompt = torch.randint(0, vocab, (20,), generator=g, device=g.device).tolist()
        states.append(sampler.add_sequence(p, prompt, grammar=AheadMask(array.array("I", bytes(4 * words)))
                                           if has else None))
    return states


def _give_masks(states, allowed):
    """Each grammar state's mask for the step: row i of ``allowed`` [rows, V] bool, packed 32 ids a word."""
    from flared.model.grammar import AheadMask

    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    bits = torch.nn.functional.pad(allowed, (0, 32 * words - vocab))
    packed = (bits.view(rows, words, 32).to(torch.int64) << torch.arange(32, device=allowed.device)).sum(-1)
    for i, s in enumerate(states):
        if s.grammar is not None:
            s.grammar = AheadMask(array.array("I", packed[i].cpu().numpy().astype("uint32")))


@pytest.mark.parametrize("full", [False, True])
def test_grammar_rows_are_masked_from_their_slots_tables(full):
    """Grammar-constrained rows (their masks staged into the slots' tables by Sampler.stage_grammar_masks) draw the
    tokens the unshaped kernels draw from the logits the torch Sampler masks, greedy rows and rows with a bias and
    penalties too, step after step with a new mask each step; a row whose slot holds no grammar is not masked."""
    from flared.model.kernels.sampling import sample_full, sample_race
    from flared.model.sampling import Sampler, SamplingParams

    vocab, dev = 3000, torch.device("cuda")
    sampler = Sampler(vocab, device=dev, max_penalty_slots=8, graph_tables=True)
    params = [SamplingParams(temperature=0.9), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, repetition_penalty=1.4, logit_bias={5: 2.0}),
              SamplingParams(temperature=0.0, logit_bias={7: 1e4}),  # no grammar: its bias wins
              SamplingParams(temperature=0.7)]  # no slot
    grammared = [True, True, True, False, False]
    g = torch.Generator(device="cuda").manual_seed(3)
    states = _grammar_states(sampler, params, grammared, g, vocab)
    assert [s.graph_grammar for s in states] == [True, True, True, None, None]
    assert [s.graph_shaped for s in states] == [True, True, True, True, False]
    assert all(s.graph_samples for s in states)
    batch = len(states)
    slots = torch.tensor([-1 if s.penalty_slot is None else s.penalty_slot for s in states], dtype=torch.int32,
                         device=dev)
    temperature = torch.tensor([p.temperature for p in params], device=dev)
    seeds = torch.arange(batch, dtype=torch.int64, device=dev) * 131 + 5
    for step in range(5):
        allowed = torch.rand(batch, vocab, generator=g, device=dev) < 0.05
        allowed[:, 7] = False  # row 3's forced token: only its own (unmasked) row may draw it
        _give_masks(states, allowed)
        logits = torch.randn(batch, vocab, device=dev, generator=g) * 3
        shaped = sampler.apply_bias_and_penalties(logits, states)
        for i, has in enumerate(grammared):
            if has:
                shaped[i] = shaped[i].masked_fill(~allowed[i], float("-inf"))
        sampler.stage_grammar_masks([s for s in states if s.graph_grammar])
        steps = torch.full((batch,), step, dtype=torch.int64, device=dev)
        buffer = logits.clone()
        if full:
            top_k = torch.tensor([0, 0, 20, 0, 0], dtype=torch.int32, device=dev)
            top_p = torch.tensor([0.9, 1.0, 0.95, 1.0, 0.8], device=dev)
            want = sample_full(shaped.clone(), temperature, top_k, top_p, seeds, steps)
            got = sample_full(buffer, temperature, top_k, top_p, seeds, steps, shape=(slots, sampler.shape_tables()))
        else:
            want = sample_race(shaped.clone(), temperature, seeds, steps)
            got = sample_race(buffer, temperature, seeds, steps, shape=(slots, sampler.shape_tables()))
        assert torch.equal(got, want), step
        assert torch.allclose(buffer[:4], shaped[:4], rtol=1e-6, atol=1e-5)
        for i in range(3):
            assert bool(allowed[i, int(got[i])]), (step, i)
        assert int(got[3]) == 7


def test_rows_drawn_apart_draw_what_the_batch_draws():
    """draw_rows (the executor's grammar rows, drawn after the step's graph once their masks are staged) gives each
    of its rows the token the whole batch's sampler gives it: gathered from its state row, shaped by its slot (its
    grammar's mask, bias, penalties), with its own temperature, top-k, top-p, min-p and chain; the token lands at
    its index and state row, counted in its slot, and nothing else is written (the bucket's spare rows none)."""
    import numpy as np

    from flared.model.kernels import min_p_log_threshold
    from flared.model.kernels.sampling import RowDraws, draw_rows, sample_full
    from flared.model.sampling import LLAMA_CPP_ORDER, Sampler, SamplingParams

    vocab, dev = 3000, torch.device("cuda")
    sampler = Sampler(vocab, device=dev, max_penalty_slots=8, graph_tables=True)
    params = [SamplingParams(temperature=0.9, top_p=0.9),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, repetition_penalty=1.4, logit_bias={5: 2.0}, top_k=20),
              SamplingParams(temperature=0.0, logit_bias={7: 1e4}),  # no grammar: drawn in the batch
              SamplingParams(temperature=0.7),  # no slot
              SamplingParams(temperature=1.2, min_p=0.05, frequency_penalty=0.3),
              SamplingParams(temperature=0.6, top_k=30, top_p=0.8, min_p=0.01, sampler_order=LLAMA_CPP_ORDER)]
    grammared = [True, True, True, False, False, True, True]
    g = torch.Generator(device="cuda").manual_seed(11)
    states = _grammar_states(sampler, params, grammared, g, vocab)
    assert [bool(s.graph_grammar) for s in states] == grammared
    batch = len(states)
    apart = [i for i, has in enumerate(grammared) if has]
    slots = torch.tensor([-1 if s.penalty_slot is None else s.penalty_slot for s in states], dtype=torch.int32,
                         device=dev)
    temperature = torch.tensor([p.temperature for p in params], device=dev)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int32, device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    min_p_log = torch.tensor([min_p_log_threshold(p.min_p, p.temperature, bool(p.sampler_order)) for p in params],
                             dtype=torch.float32, device=dev)
    chains = torch.tensor([1 if p.sampler_order else 0 for p in params], dtype=torch.int32, device=dev)
    seeds = torch.arange(batch, dtype=torch.int64, device=dev) * 977 + 13
    state_rows = [9, 2, 14, 0, 5, 11, 7]  # each row's logits at its state row
    draws = RowDraws(8, vocab, dev)
    host = np.zeros(draws.nbytes, dtype=np.uint8)
    i64, i32, f32 = draws.views(host)
    for step in range(4):
        allowed = torch.rand(batch, vocab, generator=g, device=dev) < 0.05
        _give_masks(states, allowed)
        sampler.stage_grammar_masks([states[i] for i in apart])
        logits = torch.randn(batch, vocab, device=dev, generator=g) * 3
        steps = torch.full((batch,), step, dtype=torch.int64, device=dev)
        counts_before = sampler.output_counts.clone()
        want = sample_full(logits.clone(), temperature, top_k, top_p, seeds, steps, min_p_log=min_p_log,
                           shape=(slots, sampler.shape_tables()), chain=chains)
        counts_want = sampler.output_counts.clone()
        sampler.output_counts.copy_(counts_before)
        state_logits = torch.randn(16, vocab, device=dev, generator=g)
        state_logits[state_rows] = logits
        kept = state_logits.clone()
        sampled = torch.full((batch,), -7, dtype=torch.int64, device=dev)
        last_token = torch.full((16,), -9, dtype=torch.int64, device=dev)
        k = len(apart)
        i64[0, :k], i64[1, :k] = apart, [state_rows[i] for i in apart]
        i64[2, :k], i64[3, :k] = seeds[apart].cpu().numpy(), step
        i32[0, :k], i32[1, :k], i32[2, :k] = slots[apart].cpu().numpy(), top_k[apart].cpu().numpy(), \
            chains[apart].cpu().numpy()
        f32[0, :k], f32[1, :k], f32[2, :k] = temperature[apart].cpu().numpy(), top_p[apart].cpu().numpy(), \
            min_p_log[apart].cpu().numpy()
        i64[0, k:], i64[1:, k:], i32[0, k:], i32[1:, k:] = -1, 0, -1, 0
        f32[0, k:], f32[1, k:], f32[2, k:] = 0.0, 1.0, float("-inf")
        draws.block.copy_(torch.from_numpy(host).to(dev))
        draw_rows(state_logits, draws, sampler.shape_tables(), sampled, last_token, rows=8)
        assert torch.equal(state_logits, kept)
        for i in range(batch):
            if i in apart:
                assert int(sampled[i]) == int(want[i]), (step, i)
                assert int(last_token[state_rows[i]]) == int(want[i]), (step, i)
                assert bool(allowed[i, int(want[i])]), (step, i)
            else:
                assert int(sampled[i]) == -7 and int(last_token[state_rows[i]]) == -9, (step, i)
        for i in apart:  # counted in the drawn rows' slots as the batch counts them
            slot = states[i].penalty_slot
            assert torch.equal(sampler.output_counts[slot], counts_want[slot]), (step, i)
        assert torch.equal(sampler.output_counts[states[3].penalty_slot], counts_before[states[3].penalty_slot])
        sampler.output_counts.copy_(counts_want)


@pytest.mark.parametrize("full", [False, True])
def test_shaped_greedy_rows_step_by_step_as_the_sampler_draws_them(full):
    """Greedy rows with penalties, over the whole output (vLLM's) or over llama.cpp's sliding window of prompt and
    output (the slot's ring), drawn step after step by the graphs' kernels from one Sampler's tables, give the
    tokens and counts a Sampler without tables gives them from the same logits."""
    from flared.model.kernels.sampling import sample_full, sample_race
    from flared.model.sampling import Sampler, SamplingParams

    vocab, dev = 64, torch.device("cuda")
    params = [SamplingParams(temperature=0.0, repetition_penalty=3.0, presence_penalty=0.5, max_tokens=40),
              SamplingParams(temperature=0.0, repetition_penalty=2.5, frequency_penalty=0.3, penalty_last_n=3,
                             max_tokens=40),
              SamplingParams(temperature=0.0, presence_penalty=2.0, penalty_last_n=1, max_tokens=40),
              SamplingParams(temperature=0.0, repetition_penalty=4.0, penalty_last_n=6, logit_bias={9: 0.5},
                             max_tokens=40)]
    prompts = [[3, 4, 3, 5], [1, 2, 1, 2, 7], [6], [8, 9, 10, 11, 12, 13, 14, 15]]
    graph, plain = (Sampler(vocab, device=dev, max_penalty_slots=4, graph_tables=True),
                    Sampler(vocab, device=dev, max_penalty_slots=4))
    states = [graph.add_sequence(p, q) for p, q in zip(params, prompts)]
    refs = [plain.add_sequence(p, q) for p, q in zip(params, prompts)]
    assert [s.ring_window for s in states] == [0, 3, 1, 6] and all(s.graph_shaped for s in states)
    slots = torch.tensor([s.penalty_slot for s in states], dtype=torch.int32, device=dev)
    batch = len(states)
    zeros = torch.zeros(batch, device=dev)
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(30):
        # a few likely low ids, so that the penalties keep changing the argmax
        logits = torch.randn(batch, vocab, device=dev, generator=g) + torch.linspace(3.0, 0.0, vocab, device=dev)
        want = plain.sample(logits, refs).token_ids
        seeds = steps = torch.zeros(batch, dtype=torch.int64, device=dev)
        if full:
            got = sample_full(logits.clone(), zeros, torch.zeros(batch, dtype=torch.int32, device=dev),
                              torch.ones(batch, device=dev), seeds, steps, shape=(slots, graph.shape_tables()))
        else:
            got = sample_race(logits.clone(), zeros, seeds, steps, shape=(slots, graph.shape_tables()))
        assert torch.equal(got, want), step
        for s, r in zip(states, refs):
            assert torch.equal(graph.output_counts[s.penalty_slot], plain.output_counts[r.penalty_slot]), step


def _recording_executor(hf, monkeypatch):
    """A graph executor over ``hf``'s weights and the list its decode steps' sampler variants go into."""
    from gpu_models import make_executor, serving_model

    ex = make_executor(serving_model(hf))
    picked = []
    real = ex.graphs.pick_decode

    def record(*args, **kwargs):
        key = real(*args, **kwargs)
        picked.append(key[3])
        return key

    monkeypatch.setattr(ex.graphs, "pick_decode", record)
    return ex, picked


def _logprob_executor(hf, monkeypatch, keep):
    """A graph executor over ``hf``'s weights and the list ``keep(seen, completion)`` files each polled step's
    logprobs into."""
    ex, _ = _recording_executor(hf, monkeypatch)
    seen: list = []
    real_poll = ex.poll

    def poll(*args, **kwargs):
        got = real_poll(*args, **kwargs)
        if got is not None:
            keep(seen, got)
        return got

    monkeypatch.setattr(ex, "poll", poll)
    return ex, seen


def test_temperature_only_steps_take_the_graphs_without_a_sort(hf, monkeypatch):
    """A temperature-only request's steps take the TEMPERATURE graphs, one with a top-p the FULL graphs, a greedy
    one the GREEDY graphs; the temperature-only request draws the same tokens alone and beside the top-p one (its
    steps then take the FULL graphs)."""
    from gpu_models import make_scheduler

    from flared.execution.offline import drive
    from flared.model.kernels import FULL, GREEDY, TEMPERATURE
    from flared.model.sampling import SamplingParams

    ex, picked = _recording_executor(hf, monkeypatch)
    plain = SamplingParams(temperature=0.02, seed=5, max_tokens=24)
    nucleus = SamplingParams(temperature=0.02, top_p=0.9, seed=6, max_tokens=24)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    try:
        alone = drive(make_scheduler(graph_shapes=ex.graph_shapes), ex, prompts[:1], [plain])
        assert set(picked) == {TEMPERATURE}
        picked.clear()
        both = drive(make_scheduler(graph_shapes=ex.graph_shapes), ex, prompts, [plain, nucleus])
        assert FULL in picked
        picked.clear()
        drive(make_scheduler(graph_shapes=ex.graph_shapes), ex, prompts[1:], [greedy])
        assert set(picked) == {GREEDY}
    finally:
        ex.close()
    assert both.tokens[0] == alone.tokens[0]


def test_min_p_requests_are_drawn_in_the_graphs(hf, monkeypatch):
    """A min-p request (vLLM's order, or llama.cpp's default chain, with its top-p or without) takes the FULL graphs
    and is never sampled after them by the torch Sampler; at min-p 1 every token is the argmax, as greedy
    decoding's."""
    from gpu_models import make_scheduler

    from flared.execution.offline import drive
    from flared.model.kernels import FULL
    from flared.model.sampling import LLAMA_CPP_ORDER, SamplingParams

    ex, picked = _recording_executor(hf, monkeypatch)

    def eager(*args, **kwargs):
        raise AssertionError("a min-p row was sampled after the graph")

    monkeypatch.setattr(ex, "_eager_sample", eager)
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [4, 3, 2] * 6, [8, 1, 8] * 5]
    params = [SamplingParams(temperature=0.5, min_p=0.1, seed=1, max_tokens=24),
              SamplingParams(temperature=0.5, top_k=20, min_p=0.05, sampler_order=LLAMA_CPP_ORDER, seed=2,
                             max_tokens=24),
              SamplingParams(temperature=3.0, min_p=1.0, seed=3, max_tokens=24),
              SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, sampler_order=LLAMA_CPP_ORDER,
                             seed=4, max_tokens=24)]
    try:
        got = drive(make_scheduler(graph_shapes=ex.graph_shapes), ex, prompts, params)
        assert set(picked) == {FULL}
        greedy = drive(make_scheduler(graph_shapes=ex.graph_shapes), ex, prompts,
                       [SamplingParams(temperature=0.0, max_tokens=24)] * 4)  # the same batch shapes
    finally:
        ex.close()
    assert all(len(t) == 24 for t in got.tokens)
    assert got.tokens[2] == greedy.tokens[2]


def test_bias_and_penalty_requests_are_drawn_in_the_graphs(hf, monkeypatch):
    """Requests with logit bias, vLLM's penalties, allowed ids, bad words of one token or min_tokens take the
    TEMPERATURE or FULL graphs, greedy ones too, and are never sampled after them by the torch Sampler: greedy rows
    give the tokens the torch Sampler gives them (fp32 weights), a bias that forces a token draws only it, banned
    tokens are never drawn, and a seeded drawing request repeats itself."""
    from gpu_models import make_scheduler

    from flared.execution.offline import drive
    from flared.model.kernels import GREEDY
    from flared.model.sampling import SamplingParams, SequenceSamplingState

    ex, picked = _recording_executor(hf, monkeypatch)
    real_eager = ex._eager_sample

    def eager(*args, **kwargs):
        raise AssertionError("a bias or penalty row was sampled after the graph")

    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [4, 3, 2] * 6, [12, 13] * 7]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.8, presence_penalty=0.7, max_tokens=24,
                             min_tokens=6, min_tokens_banned=frozenset({0, 1, 2, 5, 6, 7, 8})),
              # allowed ids and a bad word of one token: -inf in the slot's bias row
              SamplingParams(temperature=0.0, frequency_penalty=1.5, logit_bias={3: 2.5, 9: -4.0}, max_tokens=24,
                             allowed_token_ids=(3, 9, 21, 22, 23, 24), bad_words=((22,),)),
              SamplingParams(temperature=0.0, logit_bias={17: 1e4}, max_tokens=24),
              # llama.cpp's window (repeat_last_n), sliding over the prompt and output
              SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, penalty_last_n=6,
                             logit_bias={20: 1.0}, seed=9, max_tokens=24)]
    try:
        monkeypatch.setattr(ex, "_eager_sample", eager)
        got = drive(make_scheduler(graph_shapes=ex.graph_shapes), ex, prompts, params)
        assert GREEDY not in picked
        again = drive(make_scheduler(graph_shapes=ex.graph_shapes), ex, prompts, params)
        # the same requests sampled after the graph by the torch Sampler
        monkeypatch.setattr(ex, "_eager_sample", real_eager)
        monkeypatch.setattr(SequenceSamplingState, "graph_shaped", property(lambda self: False))
        # (the same batch: the same graphs, so the greedy rows' logits are the same bits)
        eager_run = drive(make_scheduler(graph_shapes=ex.graph_shapes), ex, prompts, params)
    finally:
        ex.close()
    assert all(len(t) == 24 for t in got.tokens)
    for i in range(3):
        assert got.tokens[i] == eager_run.tokens[i], i
    assert set(got.tokens[2]) == {17}
    assert set(got.tokens[1]) <= {3, 9, 21, 23, 24}
    assert not set(got.tokens[0][:6]) & {0, 1, 2, 5, 6, 7, 8}
    assert got.tokens == again.tokens


@pytest.mark.parametrize("shaped, top", [(True, 3), (False, 3), (True, 40)])
def test_logprob_rows_are_drawn_in_the_graphs_with_the_torch_samplers_logprobs(hf, monkeypatch, shaped, top):
    """Rows asking for log-probabilities (of the model's distribution) are drawn by the graphs, their logprobs
    taken beside the draw from the logits the graph wrote before shaping any row: greedy rows, one with penalties
    (the steps take the TEMPERATURE graphs) or none (the GREEDY graphs, whose head takes the argmax), get the
    tokens, chosen log-probabilities and top-n the torch Sampler gives them after the graph: from one kernel
    behind the graph (kernels.sampling.row_logprobs), or torch's ops for a top-n over GRAPH_LOGPROBS."""
    from gpu_models import make_scheduler

    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams, SequenceSamplingState

    ex, seen = _logprob_executor(hf, monkeypatch, lambda seen, got: seen.append(list(got[3])))
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [4, 3, 2] * 6]
    params = [SamplingParams(temperature=0.0, logprobs=top, max_tokens=16),
              SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=1.5, logit_bias={3: 1.0},
                             max_tokens=16),
              SamplingParams(temperature=0.0, max_tokens=16)]
    if not shaped:
        prompts, params = prompts[::2], params[::2]

    def run():
        seen.clear()
        r = drive(make_scheduler(graph_shapes=ex.graph_shapes), ex, prompts, params)
        return r.tokens, [lp for step in seen for lp in step if lp is not None]

    try:
        real_eager = ex._eager_sample

        def eager(*args, **kwargs):
            raise AssertionError("a logprob row was sampled after the graph")

        monkeypatch.setattr(ex, "_eager_sample", eager)
        tokens, graph_lps = run()
        monkeypatch.setattr(ex, "_eager_sample", real_eager)
        monkeypatch.setattr(SequenceSamplingState, "graph_samples", property(lambda self: False))
        eager_tokens, eager_lps = run()
    finally:
        ex.close()
    assert tokens == eager_tokens
    assert len(graph_lps) == len(eager_lps) == (32 if shaped else 16)
    # each request's in order (the first asks for a top n, the second for none; steps may order them otherwise)
    graph_lps = sorted(graph_lps, key=lambda lp: -len(lp.top))
    eager_lps = sorted(eager_lps, key=lambda lp: -len(lp.top))
    for a, b in zip(graph_lps, eager_lps):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
    assert sum(len(lp.top) == top for lp in graph_lps) == 16


def test_logprob_graphs_as_the_count_of_rows_falls(hf, monkeypatch):
    """The logprob kernels run as small graphs captured for power-of-two counts of rows; four greedy logprob
    requests ending one after another (4, 3, 2, 1 rows a step: buckets 4, 4, 2, 1, a step's rows past its own count
    set to none) get the torch Sampler's logprobs, and the same values as the kernels launched one by one
    (``logprob_graphs`` False)."""
    from gpu_models import make_scheduler

    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams, SequenceSamplingState

    ex, seen = _logprob_executor(hf, monkeypatch, lambda seen, got: seen.extend(
        (int(h), lp) for h, lp in zip(got[1].handles, got[3]) if lp is not None))
    prompts = [[5 + i, 6, 7 + 2 * i, 8] * 3 for i in range(4)]  # the executor's four slots
    params = [SamplingParams(temperature=0.0, logprobs=3, max_tokens=m) for m in (3, 6, 10, 16)]

    def run():
        seen.clear()
        r = drive(make_scheduler(graph_shapes=ex.graph_shapes), ex, prompts, params)
        by_handle: dict[int, list] = {}
        for h, lp in seen:
            by_handle.setdefault(h, []).append(lp)
        return r.tokens, [by_handle[h] for h in sorted(by_handle)]

    try:
        assert ex.logprob_graphs
        tokens, graph_lps = run()
        ex.logprob_graphs = False
        launched_tokens, launched_lps = run()
        monkeypatch.setattr(SequenceSamplingState, "graph_samples", property(lambda self: False))
        eager_tokens, eager_lps = run()
    finally:
        ex.close()
    assert tokens == launched_tokens == eager_tokens
    assert [len(x) for x in graph_lps] == [3, 6, 10, 16]
    assert graph_lps == launched_lps
    for ours, theirs in zip(graph_lps, eager_lps):
        for a, b in zip(ours, theirs, strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
