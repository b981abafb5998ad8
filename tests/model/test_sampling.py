"""Sampler semantics on synthetic logits: filters, penalties, bias, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from flared.errors import AdmissionError, ExecutionError
from flared.model.sampling import LLAMA_CPP_ORDER, VLLM_ORDER, Sampler, SamplingParams

VOCAB = 50


def logits_rows(num_rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=g) * 3


def draw_many(params: SamplingParams, logits: torch.Tensor, num_draws: int) -> torch.Tensor:
    """Draws with seeds 0..num_draws-1, all in one batch."""
    sampler = Sampler(VOCAB, max_penalty_slots=num_draws)
    states = [sampler.add_sequence(SamplingParams(**{**params.__dict__, "seed": s}), []) for s in range(num_draws)]
    return sampler.sample(logits.expand(num_draws, VOCAB).contiguous(), states).token_ids


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = logits_rows(4)
    sampler = Sampler(VOCAB)
    greedy = [sampler.add_sequence(SamplingParams(temperature=0), []) for _ in range(2)]
    top1 = [sampler.add_sequence(SamplingParams(temperature=1.5, top_k=1, seed=i), []) for i in range(2)]
    out = sampler.sample(logits, greedy + top1).token_ids
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_logit_bias_forces_and_forbids():
    logits = logits_rows(1)
    worst = int(logits[0].argmin())
    best = int(logits[0].argmax())
    sampler = Sampler(VOCAB)
    forced = sampler.add_sequence(SamplingParams(temperature=0, logit_bias={worst: 100.0}), [])
    assert sampler.sample(logits, [forced]).token_ids.tolist() == [worst]
    forbidden = [sampler.add_sequence(SamplingParams(temperature=1.0, seed=s, logit_bias={best: -1e9}), [])
                 for s in range(64)]
    assert best not in sampler.sample(logits.expand(64, VOCAB), forbidden).token_ids.tolist()
    with pytest.raises(AdmissionError, match="outside the vocabulary"):
        sampler.add_sequence(SamplingParams(logit_bias={VOCAB: 1.0}), [])


def test_min_tokens_bans_the_stop_ids_until_reached():
    logits = logits_rows(1)
    best, second = logits[0].topk(2).indices.tolist()
    sampler = Sampler(VOCAB)
    state = sampler.add_sequence(SamplingParams(temperature=0, min_tokens=2, min_tokens_banned=frozenset({best}),
                                                max_tokens=4), [])
    # the banned id is the argmax: the first two tokens take the next best, then the ban lifts
    assert [sampler.sample(logits, [state]).token_ids.item() for _ in range(3)] == [second, second, best]
    drawn = [sampler.add_sequence(SamplingParams(temperature=1.0, seed=s, min_tokens=1,
                                                 min_tokens_banned=frozenset({best, second})), [])
             for s in range(64)]
    out = sampler.sample(logits.expand(64, VOCAB), drawn).token_ids.tolist()
    assert best not in out and second not in out
    with pytest.raises(AdmissionError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_allowed_token_ids_restrict_every_draw():
    logits = logits_rows(1)
    allowed = [int(logits[0].argmin()), 7, 11]
    sampler = Sampler(VOCAB)
    greedy = sampler.add_sequence(SamplingParams(temperature=0, allowed_token_ids=tuple(allowed)), [])
    assert sampler.sample(logits, [greedy]).token_ids.item() == max(allowed, key=lambda t: logits[0, t].item())
    states = [sampler.add_sequence(SamplingParams(temperature=2.0, seed=s, allowed_token_ids=tuple(allowed)), [])
              for s in range(64)]
    out = sampler.sample(logits.expand(64, VOCAB), states)
    assert set(out.token_ids.tolist()) <= set(allowed)
    with pytest.raises(AdmissionError, match="outside the vocabulary"):
        sampler.add_sequence(SamplingParams(allowed_token_ids=(VOCAB,)), [])
    with pytest.raises(AdmissionError, match="must not be empty"):
        SamplingParams(allowed_token_ids=())


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9, 0.99])
def test_typical_filter_keeps_what_transformers_keeps(mass):
    from transformers.generation.logits_process import TypicalLogitsWarper

    from flared.model.sampling import typical_filter

    logits = logits_rows(6, seed=3)
    logits[1, :10] = float("-inf")  # rows with tokens already filtered out
    ours = typical_filter(logits, torch.full((6, 1), mass))
    theirs = TypicalLogitsWarper(mass=mass)(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(typical_filter(logits, torch.ones(6, 1)), logits)  # 1 leaves a row whole


def test_typical_p_draws_stay_in_the_typical_set():
    from flared.model.sampling import typical_filter

    logits = logits_rows(1, seed=5)
    kept = set(torch.nonzero(~torch.isinf(typical_filter(logits, torch.tensor([[0.3]]))[0])).flatten().tolist())
    drawn = draw_many(SamplingParams(temperature=1.0, typical_p=0.3), logits, 64).tolist()
    assert set(drawn) <= kept and len(kept) < VOCAB // 2


def test_penalty_window_follows_llama_cpp():
    """penalty_last_n (llama.cpp's repeat_last_n): repetition, frequency and presence penalties all count the
    last N tokens of prompt and output, and a token leaves the window N tokens later."""
    logits = logits_rows(1, seed=7)
    sampler = Sampler(VOCAB)
    params = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25,
                            penalty_last_n=3, max_tokens=8)
    prompt = [3, 4, 4, 5]
    state = sampler.add_sequence(params, prompt)
    window = prompt[-3:]
    for _ in range(5):
        counts = torch.bincount(torch.tensor(window, dtype=torch.int64), minlength=VOCAB).float()
        seen = counts > 0
        expected = torch.where(seen, torch.where(logits[0] > 0, logits[0] / 1.5, logits[0] * 1.5), logits[0])
        expected = expected - 0.5 * counts - 0.25 * seen.float()
        assert torch.allclose(sampler.apply_bias_and_penalties(logits, [state])[0], expected, atol=1e-6)
        token = sampler.sample(logits, [state]).token_ids.item()
        assert token == int(expected.argmax())
        window = (window + [token])[-3:]
    with pytest.raises(AdmissionError, match="penalty_last_n"):
        SamplingParams(penalty_last_n=-1)


def test_bad_words_ban_a_sequence_s_last_token_after_the_rest():
    logits = logits_rows(1, seed=11)
    best, second = logits[0].topk(2).indices.tolist()
    sampler = Sampler(VOCAB)
    never = sampler.add_sequence(SamplingParams(temperature=0, bad_words=((best,),)), [])
    assert [sampler.sample(logits, [never]).token_ids.item() for _ in range(3)] == [second] * 3
    # (best, best): best cannot follow itself, so the output alternates
    pair = sampler.add_sequence(SamplingParams(temperature=0, bad_words=((best, best), (7, 8, best))), [])
    assert [sampler.sample(logits, [pair]).token_ids.item() for _ in range(4)] == [best, second, best, second]
    drawn = [sampler.add_sequence(SamplingParams(temperature=1.0, seed=s, bad_words=((best,), (second,))), [])
             for s in range(32)]
    out = sampler.sample(logits.expand(32, VOCAB), drawn).token_ids.tolist()
    assert best not in out and second not in out
    with pytest.raises(AdmissionError, match="outside the vocabulary"):
        sampler.add_sequence(SamplingParams(bad_words=((1, VOCAB),)), [])


def test_thinking_budget_forces_the_end_token_once():
    logits = logits_rows(1, seed=13)
    best = int(logits[0].argmax())
    end = int(logits[0].argmin())
    sampler = Sampler(VOCAB)
    state = sampler.add_sequence(SamplingParams(temperature=0, thinking_budget=2, thinking_end=end), [])
    # two free tokens, then the end marker (the least likely token), then free again: it is drawn only once
    assert [sampler.sample(logits, [state]).token_ids.item() for _ in range(5)] == [best, best, end, best, best]
    drawn = [sampler.add_sequence(SamplingParams(temperature=1.0, seed=s, thinking_budget=0, thinking_end=end), [])
             for s in range(8)]
    assert sampler.sample(logits.expand(8, VOCAB), drawn).token_ids.tolist() == [end] * 8
    # with a start marker: forced only while open (after the marker in the prompt or in the output)
    start = int(logits[0].topk(2).indices[1])
    closed = sampler.add_sequence(SamplingParams(temperature=0, thinking_budget=0, thinking_end=end,
                                                 thinking_start=start), [start, 9, end])
    assert sampler.sample(logits, [closed]).token_ids.item() == best  # the prompt closed it: nothing forced
    opened = sampler.add_sequence(SamplingParams(temperature=0, thinking_budget=0, thinking_end=end,
                                                 thinking_start=start), [9, start])
    assert [sampler.sample(logits, [opened]).token_ids.item() for _ in range(2)] == [end, best]
    later = sampler.add_sequence(SamplingParams(temperature=0, thinking_budget=0, thinking_end=end,
                                                thinking_start=start, logit_bias={start: 100.0}), [])
    assert [sampler.sample(logits, [later]).token_ids.item() for _ in range(2)] == [start, end]
    with pytest.raises(AdmissionError, match="come together"):
        SamplingParams(thinking_budget=3)


def test_penalties_follow_vllm_semantics():
    logits = logits_rows(1)
    sampler = Sampler(VOCAB)
    params = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25,
                            max_tokens=8)
    prompt = [3, 4]
    state = sampler.add_sequence(params, prompt)
    outputs = []
    for _ in range(3):
        processed = sampler.apply_bias_and_penalties(logits, [state])[0]
        expected = logits[0].clone()
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.int64), minlength=VOCAB).float()
        seen = counts > 0
        seen[prompt] = True
        expected = torch.where(seen, torch.where(expected > 0, expected / 1.5, expected * 1.5), expected)
        expected = expected - 0.5 * counts - 0.25 * (counts > 0).float()
        assert torch.allclose(processed, expected, atol=1e-6)
        token = sampler.sample(logits, [state]).token_ids.item()
        assert token == int(processed.argmax())
        outputs.append(token)
    assert state.num_output_tokens == 3
    sampler.release(state)
    assert state.penalty_slot is None


def test_penalty_slots_are_bounded_and_reused():
    sampler = Sampler(VOCAB, max_penalty_slots=2)
    params = SamplingParams(presence_penalty=1.0)
    a, b = sampler.add_sequence(params, [1]), sampler.add_sequence(params, [2])
    with pytest.raises(ExecutionError):
        sampler.add_sequence(params, [3])
    sampler.release(a)
    c = sampler.add_sequence(params, [5])
    assert c.penalty_slot == a.penalty_slot or c.penalty_slot is not None
    # A reused slot starts clean: the old prompt token is no longer marked.
    assert not sampler.prompt_mask[c.penalty_slot, 1] and sampler.prompt_mask[c.penalty_slot, 5]
    assert b.penalty_slot != c.penalty_slot


def test_top_k_top_p_min_p_restrict_the_support():
    logits = logits_rows(1, seed=3)
    order = logits[0].argsort(descending=True).tolist()
    probs = torch.softmax(logits[0], dim=-1)

    drawn = set(draw_many(SamplingParams(top_k=5), logits, 400).tolist())
    assert drawn == set(order[:5])

    cumulative = probs[order].cumsum(0)
    nucleus = set(order[: int((cumulative < 0.8).sum()) + 1])
    drawn = set(draw_many(SamplingParams(top_p=0.8), logits, 400).tolist())
    assert drawn <= nucleus and len(drawn) >= len(nucleus) - 1

    allowed = set(torch.nonzero(probs >= 0.1 * probs.max()).flatten().tolist())
    drawn = set(draw_many(SamplingParams(min_p=0.1), logits, 400).tolist())
    assert drawn <= allowed and len(drawn) >= 2


def test_draws_follow_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0] + [-30.0] * (VOCAB - 4)])
    temperature = 1.3
    draws = draw_many(SamplingParams(temperature=temperature), logits, 4000)
    expected = torch.softmax(logits[0] / temperature, dim=-1)[:4]
    observed = torch.bincount(draws, minlength=VOCAB)[:4].float() / 4000
    assert torch.allclose(observed, expected, atol=0.03), (observed, expected)


def test_seeded_draws_do_not_depend_on_batch_position():
    logits = logits_rows(6, seed=5)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i) for i in range(6)]

    def run(order):
        sampler = Sampler(VOCAB)
        states = {i: sampler.add_sequence(params[i], []) for i in order}
        tokens = {i: [] for i in order}
        for _ in range(10):
            out = sampler.sample(logits[list(order)], [states[i] for i in order]).token_ids.tolist()
            for i, t in zip(order, out):
                tokens[i].append(t)
        return tokens

    together = run(range(6))
    reversed_ = run(range(5, -1, -1))
    alone = {i: run([i])[i] for i in (0, 3)}
    assert together == reversed_
    assert together[0] == alone[0] and together[3] == alone[3]
    assert together[0] != together[1] or together[0] != together[2]


def test_logprobs_come_from_raw_logits():
    logits = logits_rows(2, seed=7)
    sampler = Sampler(VOCAB)
    states = [sampler.add_sequence(SamplingParams(temperature=0, logprobs=3, logit_bias={0: 50.0}), []),
              sampler.add_sequence(SamplingParams(temperature=0.7, seed=1, logprobs=0), [])]
    out = sampler.sample(logits, states)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids[0].item() == 0  # the bias decides the token...
    assert out.chosen_logprobs[0].item() == pytest.approx(raw[0, 0].item())  # ...but not its logprob
    assert out.chosen_ranks[0].item() == int((raw[0] > raw[0, 0]).sum()) + 1
    top_values, top_ids = raw[0].topk(3)
    assert out.top_token_ids[0].tolist() == top_ids.tolist()
    assert torch.allclose(out.top_logprobs[0], top_values)
    assert out.chosen_logprobs[1].item() == pytest.approx(raw[1, out.token_ids[1]].item())


@pytest.mark.parametrize("kwargs", [
    {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": 2.0}, {"top_k": -1},
    {"repetition_penalty": 0.0}, {"max_tokens": 0}, {"logprobs": -1}, {"seed": "x"},
    {"logit_bias": {1: float("nan")}}, {"temperature": float("inf")},
])
def test_invalid_params_are_admission_errors(kwargs):
    with pytest.raises(AdmissionError):
        SamplingParams(**kwargs)


def test_sample_never_modifies_the_callers_logits():
    logits = logits_rows(3, seed=11)
    before = logits.clone()
    sampler = Sampler(VOCAB)
    for params in ([SamplingParams(temperature=0)] * 3,
                   [SamplingParams(temperature=0, logit_bias={1: 5.0}), SamplingParams(repetition_penalty=2.0, seed=1),
                    SamplingParams(temperature=0.5, top_k=3, min_p=0.1, seed=2)]):
        sampler.sample(logits, [sampler.add_sequence(p, [1, 2]) for p in params])
        assert torch.equal(logits, before)


def _probs(values: list[float]) -> torch.Tensor:
    """Logits whose softmax is ``values`` (padded to VOCAB with near-zero probabilities)."""
    p = torch.full((VOCAB,), 1e-9)
    p[:len(values)] = torch.tensor(values)
    return torch.log(p / p.sum())[None, :]


def test_xtc_excludes_the_likely_tokens_but_the_least_of_them():
    """llama.cpp's XTC: with probability 1, every token at least 0.1 likely goes but the least likely of them
    (0.15 here); with one such token, or probability 0, nothing changes."""
    logits = _probs([0.5, 0.3, 0.15, 0.05])
    drawn = set(draw_many(SamplingParams(xtc_probability=1.0, xtc_threshold=0.1), logits, 64).tolist())
    assert drawn <= {2, 3} and 2 in drawn
    plain = draw_many(SamplingParams(), logits, 64)
    assert torch.equal(draw_many(SamplingParams(xtc_probability=0.0), logits, 64), plain)
    single = _probs([0.9, 0.05, 0.05])
    assert 0 in set(draw_many(SamplingParams(xtc_probability=1.0, xtc_threshold=0.1), single, 32).tolist())
    # a coin per row and step, from the row's seed: about half the draws are left alone at probability 0.5
    half = draw_many(SamplingParams(xtc_probability=0.5, xtc_threshold=0.1), logits, 200)
    share = (half <= 1).float().mean().item()
    assert 0.2 < share < 0.6


def test_llama_cpp_chain_filters_at_temperature_one_then_scales():
    """llama.cpp's default chain: top-p and min-p judge the distribution at temperature 1 and the temperature
    scales only what they keep; vLLM's order scales first, so a high temperature lets more through."""
    logits = _probs([0.85, 0.12, 0.03])  # at 1: top_p 0.8 and min_p 0.2 keep token 0 alone
    for filters in ({"top_p": 0.8}, {"min_p": 0.2}):
        hot = SamplingParams(temperature=4.0, **filters)
        llama = draw_many(SamplingParams(**{**hot.__dict__, "sampler_order": LLAMA_CPP_ORDER}), logits, 64)
        assert set(llama.tolist()) == {0}, filters
        assert len(set(draw_many(hot, logits, 64).tolist())) > 1, filters  # at temperature 4 both keep more
    # what the filters keep is still drawn at the temperature: two near-equal tokens, both kept
    pair = _probs([0.5, 0.45, 0.05])
    cold = draw_many(SamplingParams(temperature=0.02, top_p=0.99, sampler_order=LLAMA_CPP_ORDER), pair, 64)
    warm = draw_many(SamplingParams(temperature=1.0, top_p=0.99, sampler_order=LLAMA_CPP_ORDER), pair, 64)
    assert (cold == 0).float().mean().item() > 0.95 and 0.3 < (warm == 0).float().mean().item() < 0.8
    # without a filter the order changes nothing: the same draws either way
    assert torch.equal(draw_many(SamplingParams(temperature=1.7, sampler_order=LLAMA_CPP_ORDER), logits, 32),
                       draw_many(SamplingParams(temperature=1.7), logits, 32))


def test_the_chain_runs_its_filters_in_its_order():
    """A sampler_order runs each filter on what the ones before kept: llama.cpp's default (top-p, then min-p) keeps
    two tokens where min-p first leaves top-p one; a chain in vLLM's order draws exactly what the batched path draws
    (the same noise per token id); a chain without the temperature draws at temperature 1."""
    logits = _probs([0.5, 0.3, 0.1, 0.1])
    both = {"temperature": 1.0, "top_p": 0.6, "min_p": 0.3}
    assert set(draw_many(SamplingParams(**both, sampler_order=LLAMA_CPP_ORDER), logits, 64).tolist()) == {0, 1}
    assert set(draw_many(SamplingParams(**both, sampler_order=("min_p", "top_p")), logits, 64).tolist()) == {0}
    rows = logits_rows(1)
    vllm = {"temperature": 1.3, "top_k": 5, "top_p": 0.9, "min_p": 0.02}
    assert torch.equal(draw_many(SamplingParams(**vllm, sampler_order=("temperature", "min_p", "top_k", "top_p")),
                                 rows, 48), draw_many(SamplingParams(**vllm), rows, 48))
    cold = SamplingParams(temperature=0.01, sampler_order=("top_k",))  # no temperature stage: drawn at 1
    assert torch.equal(draw_many(cold, rows, 48), draw_many(SamplingParams(temperature=1.0), rows, 48))
    with pytest.raises(AdmissionError, match="unknown sampler 'top_z'"):
        SamplingParams(sampler_order=("top_k", "top_z"))


def test_top_n_sigma_keeps_the_logits_near_the_largest():
    """llama.cpp's top-n-sigma: a token stays when its logit is at least max - n * std over the candidates (the
    finite logits); the temperature does not change what it keeps (both scale alike); n <= 0 is off."""
    narrow = torch.full((1, VOCAB), float("-inf"))
    narrow[0, :4] = torch.tensor([10.0, 9.5, 9.0, 4.0])  # over the four candidates: std 2.39, cut 7.6
    for temperature in (0.7, 3.0):
        drawn = set(draw_many(SamplingParams(temperature=temperature, top_n_sigma=1.0), narrow, 64).tolist())
        assert drawn == {0, 1, 2}, temperature
        chain = SamplingParams(temperature=temperature, top_n_sigma=1.0, sampler_order=LLAMA_CPP_ORDER)
        assert set(draw_many(chain, narrow, 64).tolist()) == {0, 1, 2}, temperature
    assert 3 in set(draw_many(SamplingParams(temperature=3.0, top_n_sigma=-1.0), narrow, 200).tolist())
    wide = narrow.clone()
    wide[0, 4:] = -30.0  # the rest of the vocabulary counts too: the spread grows and the cut falls below 4
    assert 3 in set(draw_many(SamplingParams(temperature=3.0, top_n_sigma=1.0), wide, 200).tolist())


def test_mirostat_v2_truncates_by_surprise_and_moves_mu():
    """mirostat 2: only tokens whose surprise -log2 p is within mu (2 tau at first) are drawn; mu then moves by
    eta times the drawn token's surprise in the kept distribution minus tau."""
    logits = _probs([0.4, 0.3, 0.2, 0.1])
    sampler = Sampler(VOCAB)
    tau, eta = 1.0, 0.5  # mu = 2: p >= 0.25 kept (tokens 0 and 1)
    state = sampler.add_sequence(SamplingParams(mirostat=2, mirostat_tau=tau, mirostat_eta=eta, seed=3), [])
    token = sampler.sample(logits, [state]).token_ids.item()
    assert token in (0, 1)
    kept = {0: 0.4 / 0.7, 1: 0.3 / 0.7}[token]
    mu = 2 * tau - eta * (-math.log2(kept) - tau)
    assert state.mirostat_mu.item() == pytest.approx(mu, rel=1e-5)
    drawn = set(draw_many(SamplingParams(mirostat=2, mirostat_tau=tau, mirostat_eta=0.0), logits, 64).tolist())
    assert drawn == {0, 1}
    # a tiny tau keeps only the most likely token
    assert set(draw_many(SamplingParams(mirostat=2, mirostat_tau=0.01), logits, 16).tolist()) == {0}


def test_mirostat_v1_keeps_the_estimated_top_k():
    """mirostat 1 (llama.cpp's): s_hat from the top 100 probabilities, k = ((s_hat - 1) 2^mu /
    (1 - N^(1 - s_hat)))^(1 / s_hat), a draw from the top k."""
    ranks = torch.arange(1, VOCAB + 1, dtype=torch.float64)
    zipf = (1 / ranks ** 1.3) / (1 / ranks ** 1.3).sum()
    logits = torch.log(zipf).float()[None, :]
    tau = 1.5
    p = zipf.tolist()
    t = [math.log((i + 2) / (i + 1)) for i in range(VOCAB - 1)]
    b = [math.log(p[i] / p[i + 1]) for i in range(VOCAB - 1)]
    s_hat = sum(x * y for x, y in zip(t, b)) / sum(x * x for x in t)
    eps = s_hat - 1
    k = max(int((eps * 2 ** (2 * tau) / (1 - VOCAB ** -eps)) ** (1 / s_hat)), 1)
    assert 1 < k < 10
    drawn = set(draw_many(SamplingParams(mirostat=1, mirostat_tau=tau, mirostat_eta=0.0), logits, 200).tolist())
    assert drawn <= set(range(k)) and len(drawn) > 1


def test_dry_penalises_the_token_that_would_extend_a_repeat():
    """llama.cpp's example: over `a b c c b c y a b c`, emitting c would repeat `a b c` (3 tokens), y would
    repeat `b c` (2) and b only `c` (1); from 2 tokens (dry_allowed_length) a token loses multiplier *
    base ** (length - 2). A breaker ends how far back a repeat reaches, and is never penalised itself."""
    a, b, c, y, brk = 1, 2, 3, 4, 5
    logits = torch.zeros(1, VOCAB)
    sampler = Sampler(VOCAB)
    params = dict(temperature=0, dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2, max_tokens=4)
    state = sampler.add_sequence(SamplingParams(**params), [a, b, c, c, b, c, y, a, b, c])
    got = sampler.apply_bias_and_penalties(logits, [state])[0]
    expected = torch.zeros(VOCAB)
    expected[c] = -0.8 * 1.75
    expected[y] = -0.8
    assert torch.allclose(got, expected)
    # a breaker two tokens from the end: repeats reach back 2 tokens at most (c: 2, y: 2, no more)
    state = sampler.add_sequence(SamplingParams(**params, dry_breakers=frozenset({brk})),
                                 [a, b, c, c, b, c, y, brk, b, c])
    got = sampler.apply_bias_and_penalties(logits, [state])[0]
    expected = torch.zeros(VOCAB)
    expected[c] = expected[y] = -0.8
    assert torch.allclose(got, expected)
    # the window: only the last 3 tokens count (`y a b c`... here `a b c`: no earlier repeat)
    state = sampler.add_sequence(SamplingParams(**params, dry_penalty_last_n=3), [a, b, c, c, b, c, y, a, b, c])
    assert torch.equal(sampler.apply_bias_and_penalties(logits, [state])[0], torch.zeros(VOCAB))
    # drawn tokens join the history: after `a b c a`, nothing would repeat 2 tokens; once b is drawn, c would
    # repeat `a b`
    state = sampler.add_sequence(SamplingParams(**params, logit_bias={b: 1.0}), [a, b, c, a])
    assert sampler.apply_bias_and_penalties(logits, [state])[0][c].item() == 0.0
    assert sampler.sample(logits, [state]).token_ids.item() == b
    shaped = sampler.apply_bias_and_penalties(logits, [state])[0]
    assert shaped[c].item() == pytest.approx(-0.8) and shaped[b].item() == 1.0


@pytest.mark.parametrize("kwargs", [
    {"mirostat": 3}, {"mirostat_tau": -1.0}, {"xtc_probability": 1.5}, {"xtc_threshold": -0.1},
    {"dry_multiplier": -1.0}, {"dry_multiplier": 0.8, "dry_base": 0.5}, {"dry_allowed_length": -1},
    {"dry_penalty_last_n": -2},
])
def test_invalid_llama_sampler_params_are_admission_errors(kwargs):
    with pytest.raises(AdmissionError):
        SamplingParams(**kwargs)


def _dry_reference(history, vocab, multiplier, base, allowed, last_n, breakers, restarts=()):
    """llama.cpp's DRY written out plainly: each earlier position's repeat length (the longest common suffix
    with the whole window, cut at the last breaker), the longest per following token, the penalties. The last
    breaker as llama.cpp's step 1 finds it: scanning back from the end, the first token that is a breaker or heads
    a restart sequence whose tail follows it (the longest such tail)."""
    w = history[-last_n:] if last_n else list(history)
    n = len(w)
    penalty = [0.0] * vocab
    if n < 2:
        return penalty
    sequences = [(b, ()) for b in breakers] + list(restarts)
    rep_limit = n
    for i in range(n):  # i tokens from the end
        longest_match = -1
        for head, tail in sequences:
            if head == w[n - 1 - i] and longest_match < len(tail) <= i and all(
                    tail[k] == w[n - 1 - (i - k - 1)] for k in range(len(tail))):
                longest_match = len(tail)
        if longest_match >= 0:
            rep_limit = i - longest_match
            break
    longest = {}
    for j in range(n - 1):
        length = 0
        while length <= j and length < 64 and w[j - length] == w[n - 1 - length]:
            length += 1
        length = min(length, rep_limit)
        if length >= allowed:
            longest[w[j + 1]] = max(longest.get(w[j + 1], -1), length)
    cap = int(88.7228391 / math.log(base)) if base > 1.000001 else None
    for token, length in longest.items():
        if token not in breakers:
            exponent = length - allowed if cap is None else min(length - allowed, cap)
            penalty[token] = multiplier * base ** exponent
    return penalty


@pytest.mark.parametrize("restarts, lengths", [
    ((), {5: 6}),  # no breaker: `a b 5 6 a b` repeats, and 5 would extend it (6 tokens)
    (((5, (6,)),), {5: 2}),  # the pair `5 6` a breaker: repeats reach back 2 tokens (after it)
    (((5, (6,)), (5, (6, 1))), {5: 1}),  # `5 6 a` too: the longest tail at that head wins, 1 token after it
    (((5, (7,)),), {5: 6}),  # a tail that does not follow its head is no breaker
    (((6, (1, 2, 6)),), {5: 6}),  # nor one that would run past the window's end
    (((6, (1, 2, 5)),), {5: 3}),  # where the last head's tail runs past the end, an earlier whole one counts
])
def test_dry_restart_sequences_end_repeats_like_breakers(restarts, lengths):
    """llama.cpp's restart sequences (breakers several tokens spell): a head token followed by its tail ends how
    far back a repeat reaches, as a breaker token does, counted from the tail's end; the tokens themselves stay
    penalisable."""
    a, b = 1, 2
    history = [a, b, 5, 6, a, b, 5, 6, a, b]
    params = SamplingParams(temperature=0, dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=1,
                            dry_restarts=restarts, max_tokens=1)
    sampler = Sampler(VOCAB)
    got = -sampler.apply_bias_and_penalties(torch.zeros(1, VOCAB), [sampler.add_sequence(params, history)])[0]
    expected = torch.zeros(VOCAB)
    for token, length in lengths.items():
        expected[token] = 0.8 * 1.75 ** (length - 1)
    assert torch.allclose(got, expected), got.nonzero()
    assert torch.allclose(got, torch.tensor(_dry_reference(history, VOCAB, 0.8, 1.75, 1, 0, (), restarts)))


@pytest.mark.parametrize("seed", range(12))
def test_dry_matches_a_plain_reading_of_llama_cpp(seed):
    g = torch.Generator().manual_seed(seed)
    alphabet = 3 + seed  # few distinct tokens: long repeats
    history = torch.randint(0, alphabet, (int(torch.randint(2, 120, (1,), generator=g)),), generator=g).tolist()
    allowed = seed % 3  # 0 takes the unfiltered path
    last_n = [0, 7, 50][seed % 3]
    breakers = frozenset({seed % alphabet}) if seed % 2 else frozenset()
    # restart sequences: heads with tails of one to three tokens (some heads also breakers, one tail repeated)
    restarts = [] if seed % 3 == 2 else [(1, (2,)), (1, (2, 0)), (2, (seed % alphabet, 1, 1)), (0, (0,))][:2 + seed % 3]
    params = SamplingParams(temperature=0, dry_multiplier=0.5, dry_base=1.3, dry_allowed_length=allowed,
                            dry_penalty_last_n=last_n, dry_breakers=breakers, dry_restarts=tuple(restarts),
                            max_tokens=1)
    sampler = Sampler(VOCAB)
    state = sampler.add_sequence(params, history)
    got = -sampler.apply_bias_and_penalties(torch.zeros(1, VOCAB), [state])[0]
    expected = torch.tensor(_dry_reference(history, VOCAB, 0.5, 1.3, allowed, last_n, breakers, restarts))
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (history, got.nonzero(), expected.nonzero())


@pytest.mark.parametrize("rows", [
    [{"top_p": 0.9}] * 3,  # top-p alone: the shortlist instead of a sort
    [{"top_p": 0.9}, {"top_k": 7}, {"top_k": 1024, "top_p": 0.5}, {"top_p": 0.95, "min_p": 0.01}],  # mixed rows
    [{"top_p": 0.9}, {}],  # a row that keeps everything: the vocabulary is sorted
    [{"top_p": 0.9999}],  # the cut lies past the shortlist (flat tails): sorted
    [{"top_p": 0.9, "sampler_order": LLAMA_CPP_ORDER}, {"top_k": 3, "top_p": 0.8, "sampler_order": LLAMA_CPP_ORDER}],
])
def test_the_cpu_shortlist_draws_what_the_sorted_vocabulary_draws(monkeypatch, rows):
    """Top-p on the CPU tries each row's SHORTLIST most likely tokens before sorting the vocabulary: the same tokens
    drawn, step after step, as with the whole vocabulary sorted (SHORTLIST past the vocabulary)."""
    from flared.model import sampling

    vocab = 6000
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(len(rows), vocab, generator=g) * 2.5

    def draws():
        sampler = Sampler(vocab, max_penalty_slots=len(rows))
        states = [sampler.add_sequence(SamplingParams(temperature=0.9, seed=i, **kw), []) for i, kw in enumerate(rows)]
        return torch.stack([sampler.sample(logits, states).token_ids for _ in range(24)])

    short = draws()
    monkeypatch.setattr(sampling, "SHORTLIST", 10 ** 9)  # never shorter than the vocabulary: always sorted
    assert torch.equal(short, draws())


@pytest.mark.parametrize("rows", [
    # llama.cpp's default chain with top-k, top-p and min-p, mixed: the shortlist (rows without a top-k), then sorted
    [{"top_k": 40, "top_p": 0.9, "min_p": 0.05}, {"top_p": 0.8}, {"min_p": 0.2}, {"top_k": 7, "temperature": 1.7},
     {"top_p": 0.95, "min_p": 0.3, "temperature": 0.4}, {}],
    [{"top_k": 40, "top_p": 0.5}, {"top_k": 3, "min_p": 0.1}, {"top_k": 200, "top_p": 0.95, "temperature": 1.3}],
    [{"top_p": 0.9}, {"top_p": 0.5, "min_p": 0.05}],
    # no top-k in the batch: the walk up the ranking, judging the logits before the temperature, min-p after top-p
    [{"top_p": 0.8}, {"min_p": 0.2}, {"top_p": 0.95, "min_p": 0.3, "temperature": 0.4}, {},
     {"top_p": 0.5, "temperature": 1.6}, {"top_p": 0.3, "min_p": 0.5, "temperature": 2.5}],
    # beside rows of another chain and of vLLM's order, and a row of the default chain with XTC (a row at a time)
    [{"top_k": 40, "top_p": 0.9}, {"top_p": 0.9, "sampler_order": ("top_p", "temperature")},
     {"top_k": 20, "top_p": 0.9, "sampler_order": ()}, {"top_p": 0.9, "xtc_probability": 0.5}],
])
def test_llama_cpp_default_chain_rows_draw_batched_what_they_draw_alone(rows):
    """Rows of llama.cpp's default chain with nothing but top-k, top-p, min-p and the temperature are drawn batched
    (Sampler._draw_default_chain; with no top-k in the batch by the walk up the ranking): every row draws, step after
    step, what it draws through its own chain a row at a time (_draw_chain, the reference), whatever rows it is
    batched with."""
    vocab = 6000
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(len(rows), vocab, generator=g) * 2.0
    params = [SamplingParams(**{"temperature": 0.8, "seed": 30 + i, "sampler_order": LLAMA_CPP_ORDER, **kw})
              for i, kw in enumerate(rows)]
    batched, alone = Sampler(vocab, max_penalty_slots=len(rows)), Sampler(vocab, max_penalty_slots=len(rows))
    states = [batched.add_sequence(p, []) for p in params]
    singles = [alone.add_sequence(p, []) for p in params]
    for step in range(16):
        got = batched.sample(logits, states).token_ids.tolist()
        want = []
        for i, s in enumerate(singles):
            if s.params.sampler_order:
                want.append(int(alone._draw_chain(logits[i:i + 1], s)))
            else:
                want.append(int(alone._draw(logits[i:i + 1], [s])[0]))
            s.num_output_tokens += 1
        assert got == want, step


def _infill_reference(cands, eog, eot, pieces):
    """llama.cpp's infill sampler as it is written, on an array of (id, logit) the stages before kept: the token
    ids a draw can give (those kept with a finite logit), or {eot} where it falls back to that token."""
    data = [[t, lg, 0.0] for t, lg in sorted(cands, key=lambda c: -c[1])]
    top = data[0][1]
    weights = [math.exp(d[1] - top) for d in data]
    for d, w in zip(data, weights):
        d[2] = w / sum(weights)
    p_txt = sum(d[2] for d in data if d[0] not in eog)
    p_eog = sum(d[2] for d in data if d[0] in eog)
    if 3 * p_eog * len(data) > p_txt:
        return {d[0] for d in data if d[0] in eog}
    for i0 in range(len(data)):
        for i1 in range(len(data)):
            if data[i0][1] == float("-inf"):
                break
            if i0 == i1 or data[i1][1] == float("-inf"):
                continue
            t0, t1 = pieces[data[i0][0]], pieces[data[i1][0]]
            if 0 < len(t0) <= len(t1) and t1[:len(t0)] == t0:
                dst, src = (i1, i0) if data[i1][2] > data[i0][2] else (i0, i1)
                data[dst][2] += data[src][2]
                data[src][1], data[src][2] = float("-inf"), 0.0
    kept = [d for d in data if not (d[2] < 0.2 and d[0] not in eog)]
    texts = sum(1 for d in kept if d[0] not in eog)
    if texts == 0:
        return {eot}
    total = sum(d[2] for d in kept)
    kept = [d for d in kept if not (d[2] / total < 1 / (texts + 1) and d[0] not in eog)]
    return {d[0] for d in kept if d[1] != float("-inf")}


# token texts with many prefixes among them ("a", "ab", "abb"...), two special tokens (b"") and two end tokens
_PIECES = tuple([b"", b""] + [bytes(w) for w in (b"a", b"ab", b"abb", b"b", b"ba", b"bab", b"bb", b"c", b"ca",
                                                     b"cab", b"abc", b"x", b"xy", b"xyz", b"y")]
                + [b"z%d" % i for i in range(VOCAB - 17)])
_EOG = frozenset({0, 1})


@pytest.mark.parametrize("seed", range(40))
def test_the_infill_stage_keeps_what_llama_cpp_keeps(seed):
    """infill_filter against the literal reading: the same candidates survive (or the same fall back to the
    end-of-text token), over random logits on texts that prefix each other, with and without top-k before it."""
    from flared.model.sampling import infill_filter

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, VOCAB, generator=g) * (1 + seed % 4)
    logits[0, 17:] -= 6  # the texts without prefixes mostly unlikely
    if seed % 5 == 0:
        logits[0, 0] += 4  # an end token likely: the end-only branch
    params = SamplingParams(temperature=1.0, sampler_order=("infill",), infill_eog=_EOG, infill_eot=1,
                            token_pieces=_PIECES)
    top_k = (None, 8, 3)[seed % 3]
    if top_k is None:
        got_logits, ids = infill_filter(logits, None, params)
        cands = list(enumerate(logits[0].tolist()))
    else:
        vals, ids = logits.topk(top_k, dim=-1)
        got_logits, ids = infill_filter(vals, ids, params)
        cands = list(zip(ids[0].tolist(), vals[0].tolist()))
    got = {t for t, v in zip(ids[0].tolist(), got_logits[0].tolist()) if v != float("-inf")}
    assert got == _infill_reference(cands, _EOG, 1, _PIECES)


def test_the_infill_stage_merges_prefixes_and_falls_back_to_the_end_token():
    from flared.model.sampling import infill_filter

    params = SamplingParams(temperature=1.0, sampler_order=("infill",), infill_eog=_EOG, infill_eot=1,
                            token_pieces=_PIECES)

    def kept(probs):
        logits = torch.full((1, VOCAB), float("-inf"))
        for t, pr in probs.items():
            logits[0, t] = math.log(pr)
        out, ids = infill_filter(logits, None, params)
        return {t for t, v in zip(ids[0].tolist(), out[0].tolist()) if v != float("-inf")}

    a, ab, abb, b, x = 2, 3, 4, 5, 14
    # "a" (0.15) begins "ab" (0.3) and "abb" (0.15): one candidate of 0.6 under "ab"; "b" falls below 0.2, and
    # "x" stays above 1 / 3 of what is left
    assert kept({a: 0.15, ab: 0.3, abb: 0.15, b: 0.05, x: 0.35}) == {ab, x}
    # with "x" at 0.25, 0.25 / 0.85 falls below 1 / 3: "ab" alone
    assert kept({a: 0.15, ab: 0.3, abb: 0.15, b: 0.15, x: 0.25}) == {ab}
    # nothing reaches 0.2 after merging: the end-of-text token only (here not a candidate at all)
    assert kept({a: 0.1, b: 0.1, x: 0.1, 16: 0.1, 17: 0.1, 18: 0.1, 19: 0.1, 20: 0.1, 21: 0.1, 22: 0.1}) == {1}
    # the end token likely enough (3 * 0.15 * 3 candidates > 0.85): only the end tokens stay
    assert kept({0: 0.15, ab: 0.45, x: 0.4}) == {0}
    # not quite (3 * 0.05 * 3 < 0.95): the end token stays beside the texts that pass
    assert kept({0: 0.05, ab: 0.5, x: 0.45}) == {0, ab, x}


def test_a_chain_with_infill_draws_only_what_it_keeps():
    """Through the Sampler: llama.vim's chain (top_k, top_p, infill) draws only the candidates the stage keeps, and
    without a temperature stage a temperature of 0 does not make the row greedy (llama.cpp's chain ignores it)."""
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 3] = math.log(0.3)  # "ab"
    logits[0, 2] = math.log(0.15)  # "a": merged into "ab"
    logits[0, 14] = math.log(0.28)  # "x"
    logits[0, 5] = math.log(0.12)  # "b": below 0.2
    chain = ("top_k", "top_p", "infill")
    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature, top_k=40, top_p=0.99, sampler_order=chain,
                                infill_eog=_EOG, infill_eot=1, token_pieces=_PIECES)
        assert not params.greedy
        assert set(draw_many(params, logits, 64).tolist()) == {3, 14}
    assert SamplingParams(temperature=0.0, sampler_order=("top_k", "temperature")).greedy
    with pytest.raises(AdmissionError):
        SamplingParams(sampler_order=("infill",))  # without the model's token texts


def _dynatemp_reference(logits, temp, delta, exponent):
    """llama.cpp's temp_ext stage as written, on the finite candidates (in their order): the scaled logits."""
    cand = [x for x in logits if x != float("-inf")]
    if len(cand) <= 1:
        return list(logits)
    lo, hi = max(0.0, temp - delta), temp + delta
    top = max(cand)
    w = [math.exp(x - top) for x in cand]
    probs = [x / sum(w) for x in w]
    entropy = -sum(q * math.log(q) for q in probs if q > 0)
    t = lo + (hi - lo) * (entropy / -math.log(1.0 / len(cand))) ** exponent
    if t <= 0:
        best = logits.index(top)
        return [x if i == best else float("-inf") for i, x in enumerate(logits)]
    return [x / t for x in logits]


@pytest.mark.parametrize("seed", range(10))
def test_dynamic_temperature_scales_as_llama_cpp(seed):
    from flared.model.sampling import dynamic_temperature

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 12, generator=g) * (0.2 + seed)  # flat (high entropy) to peaked (low)
    logits[0, torch.randperm(12, generator=g)[:seed % 4]] = float("-inf")
    temp, delta, exponent = (0.0, 0.5, 1.0) if seed % 3 == 0 else (0.8, 0.6 * (seed % 3), 0.5 + seed / 4)
    params = SamplingParams(temperature=temp, dynatemp_range=delta, dynatemp_exponent=exponent,
                            sampler_order=LLAMA_CPP_ORDER)
    got = dynamic_temperature(logits, params)[0].tolist()
    expected = _dynatemp_reference(logits[0].tolist(), temp, delta, exponent)
    assert got == pytest.approx(expected, rel=1e-4)


def test_dynamic_temperature_in_the_chain():
    """A flat distribution is drawn at the top of the range, a peaked one near its bottom; temperature 0 with a
    range is not greedy; rows with it never take the graph's own sampler."""
    flat = torch.zeros(1, VOCAB)
    peaked = torch.full((1, VOCAB), -4.0)
    peaked[0, 7] = 4.0
    for order in (LLAMA_CPP_ORDER, ()):  # llama.cpp's chain, and vLLM's order (the OpenAI routes)
        kw = dict(temperature=0.0, dynatemp_range=1.5, sampler_order=order or VLLM_ORDER)
        params = SamplingParams(**kw)
        assert not params.greedy
        assert len(set(draw_many(params, flat, 64).tolist())) > 20  # entropy at its maximum: temperature 1.5
        assert set(draw_many(params, peaked, 64).tolist()) == {7}
    # a temperature so small the scaled logits would overflow float: its limit, the argmax alone (no NaN draws)
    from flared.model.sampling import dynamic_temperature

    tiny = SamplingParams(temperature=0.0, dynatemp_range=1e-4, dynatemp_exponent=8.0, sampler_order=LLAMA_CPP_ORDER)
    out = dynamic_temperature(peaked * 10, tiny)
    assert torch.isfinite(out).sum().item() == 1 and out[0, 7].item() == 40.0
    state = Sampler(VOCAB).add_sequence(SamplingParams(temperature=0.7, dynatemp_range=0.3,
                                                       sampler_order=LLAMA_CPP_ORDER), [])
    assert not state.graph_samples
    with pytest.raises(AdmissionError):
        SamplingParams(dynatemp_range=-1.0, sampler_order=LLAMA_CPP_ORDER)


def test_adaptive_p_draws_near_its_moving_target():
    """llama.cpp's adaptive-p: with a target of 0.1 it avoids a token of probability 0.9 that a plain draw takes
    nearly always; after each pick the decaying sums move by the pick's probability before the change, as
    llama.cpp's accept does (weighted = p + decay * weighted, total = 1 + decay * total)."""
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 0] = math.log(0.9)
    logits[0, 1:11] = math.log(0.01)
    chain = ("top_k", "adaptive_p")
    plain = draw_many(SamplingParams(temperature=1.0, sampler_order=("top_k",)), logits, 64).tolist()
    assert plain.count(0) > 48
    params = SamplingParams(temperature=1.0, sampler_order=chain, adaptive_target=0.1, adaptive_decay=0.5, seed=4)
    assert draw_many(params, logits, 64).tolist().count(0) < 4
    sampler = Sampler(VOCAB)
    state = sampler.add_sequence(params, [])
    weighted, total = 0.1 / 0.5, 1 / 0.5
    for _ in range(6):
        token = int(sampler.sample(logits, [state]).token_ids[0])
        p = 0.9 if token == 0 else 0.01
        weighted, total = p + 0.5 * weighted, 1 + 0.5 * total
        assert state.adaptive_sums.tolist() == pytest.approx([weighted, total], rel=1e-5)
    # the reshaped logits, llama.cpp's formula written out
    from flared.model.sampling import adaptive_p_logits

    probs = torch.softmax(logits, dim=-1)
    got = adaptive_p_logits(logits, probs, torch.tensor(0.25))[0]
    for i in range(VOCAB):
        if i > 10:
            assert got[i].item() == float("-inf")
        else:
            dist = abs(probs[0, i].item() - 0.25) / 0.3
            assert got[i].item() == pytest.approx(5.0 - 10.0 * dist * dist / (1.0 + dist), rel=1e-5)
    # a negative target: a plain draw, no state
    off = Sampler(VOCAB).add_sequence(SamplingParams(temperature=1.0, sampler_order=chain, adaptive_target=-1.0), [])
    assert off.adaptive_sums is None


def test_post_sampling_logprobs_describe_the_distribution_drawn_from():
    """post_sampling_probs: a chain row's logprobs are those of the candidates its draw was made from (top-k 3 at
    temperature 0.5 here), padded with id -1 past them; a greedy row's token is certain; other rows keep the
    model's."""
    logits = logits_rows(1, seed=3)
    sampler = Sampler(VOCAB, max_penalty_slots=3)
    chain = SamplingParams(temperature=0.5, top_k=3, logprobs=5, seed=1, sampler_order=LLAMA_CPP_ORDER,
                           post_sampling_probs=True)
    greedy = SamplingParams(temperature=0.0, logprobs=2, sampler_order=LLAMA_CPP_ORDER, post_sampling_probs=True)
    plain = SamplingParams(temperature=0.5, top_k=3, logprobs=2, seed=1, sampler_order=LLAMA_CPP_ORDER)
    states = [sampler.add_sequence(p, []) for p in (chain, greedy, plain)]
    out = sampler.sample(logits.expand(3, VOCAB).contiguous(), states)
    vals, ids = logits[0].topk(3)
    expected = torch.log_softmax(vals / 0.5, dim=0)
    token = int(out.token_ids[0])
    assert token in ids.tolist()
    assert out.chosen_logprobs[0].item() == pytest.approx(expected[ids.tolist().index(token)].item(), abs=1e-5)
    assert out.top_token_ids[0].tolist() == ids.tolist() + [-1, -1]
    assert torch.allclose(out.top_logprobs[0, :3], expected, atol=1e-5)
    assert out.chosen_logprobs[1].item() == 0.0 and out.top_token_ids[1, 0].item() == int(out.token_ids[1])
    raw = torch.log_softmax(logits[0], dim=0)
    assert out.chosen_logprobs[2].item() == pytest.approx(raw[int(out.token_ids[2])].item(), abs=1e-6)
    with pytest.raises(AdmissionError):
        SamplingParams(post_sampling_probs=True)  # no chain


def test_a_token_holding_nearly_all_the_mass_is_always_drawn():
    """Every other token of these rows has probability e^-40 (2e-13 together): in 6,400 draws none may win. The
    race's noise must never make one: a uniform of exactly 0 (2^-24 a token with torch's float32 draws, about one
    row-step in 340 at 49,152 tokens) gave E = 0, clamped to the smallest float, and that token won whatever its
    probability."""
    vocab, rows = 49152, 64
    logits = torch.full((rows, vocab), -40.0)
    logits[:, 7] = 0.0
    sampler = Sampler(vocab)
    states = [sampler.add_sequence(SamplingParams(temperature=1.0, seed=i), []) for i in range(rows)]
    for step in range(100):
        drawn = sampler.sample(logits, states).token_ids
        assert bool((drawn == 7).all()), (step, drawn[drawn != 7].tolist())
