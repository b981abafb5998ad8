"""Sampler semantics on synthetic logits: filters, penalties, bias, seeds, logprobs."""

from __future__ import annotations

import pytest
import torch

from flared.errors import AdmissionError, ExecutionError
from flared.model.sampling import Sampler, SamplingParams

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
