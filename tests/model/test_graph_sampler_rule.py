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
