"""Which rows the GPU executor samples eagerly (after the graph) instead of in the graph's own sampler, which
takes temperature, top-k and top-p with the temperature first (vLLM's order): everything that sampler does not
do, llama.cpp's chain with a top-p (its filters judge the distribution before the temperature), and any chain but
llama.cpp's default (it may leave out the temperature or top-k)."""

from __future__ import annotations

import pytest

from flared.model.sampling import LLAMA_CPP_ORDER, Sampler, SamplingParams


@pytest.mark.parametrize("params, eager", [
    (SamplingParams(temperature=0.8, top_k=40, top_p=0.95), False),
    (SamplingParams(temperature=0.8, top_k=40, sampler_order=LLAMA_CPP_ORDER), False),  # top-k: order-blind
    (SamplingParams(temperature=0.8, top_p=0.95, sampler_order=LLAMA_CPP_ORDER), True),
    (SamplingParams(temperature=0.8, top_k=40, sampler_order=("top_k",)), True),  # no temperature in the chain
    (SamplingParams(temperature=0.8, top_n_sigma=1.0), True),
    (SamplingParams(temperature=0.8, min_p=0.05), True),
    (SamplingParams(temperature=0.8, xtc_probability=0.5), True),
    (SamplingParams(temperature=0.8, mirostat=2), True),
])
def test_the_graph_sampler_draws_only_what_it_can(params, eager):
    state = Sampler(64).add_sequence(params, [])
    assert state.graph_samples is not eager


@pytest.mark.parametrize("params, position_only, graph_drawable", [
    (SamplingParams(temperature=0.0), True, True),
    (SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=3), True, True),
    (SamplingParams(temperature=0.8, top_k=40, sampler_order=LLAMA_CPP_ORDER), True, True),
    (SamplingParams(temperature=0.8, min_p=0.05, logit_bias={3: 2.0}), True, False),
    (SamplingParams(temperature=0.8, xtc_probability=0.5, xtc_threshold=0.05), True, False),
    (SamplingParams(temperature=0.8, min_tokens=3, min_tokens_banned=frozenset({1}), max_tokens=8), True, False),
    (SamplingParams(temperature=0.8, top_p=0.95, sampler_order=LLAMA_CPP_ORDER), True, False),
    (SamplingParams(temperature=0.8, repetition_penalty=1.2), False, False),
    (SamplingParams(temperature=0.8, bad_words=((4, 5),)), False, False),
    (SamplingParams(temperature=0.8, mirostat=2), False, False),
    (SamplingParams(temperature=0.8, dry_multiplier=0.8), False, False),
    (SamplingParams(temperature=0.8, logprobs=2), True, False),
])
def test_which_requests_speculative_steps_can_verify(params, position_only, graph_drawable):
    """position_only: every draw is a function of its position's logits, the seed and the draw count, so a
    speculative step may draw at every fed position (the CPU executor); graph_drawable: also one the decode graph's
    sampler takes at every position (the GPU executor). A position-only state drawn ahead with at_position draws
    what it draws when it gets there; at_position refuses any other."""
    import torch

    assert params.position_only is position_only and params.graph_drawable is graph_drawable
    if graph_drawable:
        assert params.position_only
    sampler = Sampler(64)
    state = sampler.add_sequence(params, [1, 2, 3])
    rows = torch.randn(6, 64, generator=torch.Generator().manual_seed(7)) * 3
    if not position_only:
        with pytest.raises(ValueError):
            sampler.at_position(state, 1)
        return
    ahead = [sampler.at_position(state, j) for j in range(6)]
    if graph_drawable:
        assert all(s.graph_samples for s in ahead)
    at_once = sampler.sample(rows, ahead).token_ids.tolist()
    assert state.num_output_tokens == 0  # the copies moved, not the state
    one_by_one = [int(sampler.sample(rows[j:j + 1], [state]).token_ids[0]) for j in range(6)]
    assert at_once == one_by_one
    fresh = sampler.add_sequence(params, [1, 2, 3])
    fresh.seed = state.seed
    sampler.advance(fresh, one_by_one)
    assert fresh.num_output_tokens == state.num_output_tokens == 6
