"""Which rows the GPU executor samples eagerly (after the graph) instead of in the graph's own sampler, which
takes temperature, min-p, top-k and top-p in vLLM's order (the temperature first) or in llama.cpp's default chain
(its filters judge the distribution before the temperature): everything that sampler does not do, and any chain but
llama.cpp's default (it may leave out the temperature or top-k)."""

from __future__ import annotations

import pytest

from flared.model.sampling import LLAMA_CPP_ORDER, Sampler, SamplingParams


@pytest.mark.parametrize("params, eager", [
    (SamplingParams(temperature=0.8, top_k=40, top_p=0.95), False),
    (SamplingParams(temperature=0.8, top_k=40, sampler_order=LLAMA_CPP_ORDER), False),  # top-k: order-blind
    (SamplingParams(temperature=0.8, top_p=0.95, sampler_order=LLAMA_CPP_ORDER), False),
    (SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, sampler_order=LLAMA_CPP_ORDER), False),
    (SamplingParams(temperature=0.8, top_p=0.95, sampler_order=("top_p", "temperature")), True),
    (SamplingParams(temperature=0.8, top_k=40, sampler_order=("top_k",)), True),  # no temperature in the chain
    (SamplingParams(temperature=0.8, top_n_sigma=1.0), True),
    (SamplingParams(temperature=0.8, min_p=0.05), False),
    (SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05), False),
    (SamplingParams(temperature=0.8, top_k=40, min_p=0.05, sampler_order=LLAMA_CPP_ORDER), False),
    (SamplingParams(temperature=0.8, min_p=0.05, logit_bias={3: 2.0}), True),
    (SamplingParams(temperature=0.8, min_p=0.05, typical_p=0.9), True),
    (SamplingParams(temperature=0.8, top_p=0.9, logprobs=5), False),  # taken beside the graph's draw
    (SamplingParams(temperature=0.8, top_k=40, logprobs=5, sampler_order=LLAMA_CPP_ORDER, post_sampling_probs=True),
     True),
    (SamplingParams(temperature=0.8, xtc_probability=0.5), True),
    (SamplingParams(temperature=0.8, mirostat=2), True),
])
def test_the_graph_sampler_draws_only_what_it_can(params, eager):
    state = Sampler(64).add_sequence(params, [])
    assert state.graph_samples is not eager


@pytest.mark.parametrize("params, graph", [
    (SamplingParams(temperature=0.8, min_p=0.05, logit_bias={3: 2.0}), True),
    (SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5), True),
    (SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, logit_bias={3: -100.0}), True),
    # llama.cpp's window, kept in the slot's ring; one longer than the ring that slides within the request is left
    # to the eager path's history, one that never slides needs no ring
    (SamplingParams(temperature=0.8, repetition_penalty=1.1, penalty_last_n=64, max_tokens=200), True),
    (SamplingParams(temperature=0.8, repetition_penalty=1.1, penalty_last_n=2000, max_tokens=4000), False),
    (SamplingParams(temperature=0.8, repetition_penalty=1.1, penalty_last_n=5000, max_tokens=16), True),
    # log-probabilities of the model's distribution are taken beside the graph's draw; of the one drawn from not
    (SamplingParams(temperature=0.8, repetition_penalty=1.1, logprobs=1), True),
    (SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.1, logprobs=1, sampler_order=LLAMA_CPP_ORDER,
                    post_sampling_probs=True), False),
    # allowed ids and bad words of one token: -inf in the slot's bias row; a longer bad word depends on the output
    (SamplingParams(temperature=0.0, frequency_penalty=1.0, bad_words=((7,),)), True),
    (SamplingParams(temperature=0.8, logit_bias={3: 2.0}, allowed_token_ids=(3, 4, 5)), True),
    (SamplingParams(temperature=0.8, allowed_token_ids=(3, 4), bad_words=((4,), (9,))), True),
    (SamplingParams(temperature=0.8, bad_words=((7,), (7, 8))), False),
    # min_tokens: its bans (EOS and the stop ids, up to GRAPH_BANS) in the slot's tables while fewer are drawn
    (SamplingParams(temperature=0.8, min_tokens=3, min_tokens_banned=frozenset({1, 9}), max_tokens=8), True),
    (SamplingParams(temperature=0.0, min_tokens=3, min_tokens_banned=frozenset(range(20, 29)), max_tokens=8), False),
])
def test_with_graph_tables_bias_and_penalties_are_drawn_in_the_graph(params, graph):
    """A Sampler keeping graph tables (the GPU executor's) gives a request with logit bias, vLLM's penalties,
    allowed ids or bad words of one token a slot whose tables hold them, and the graph's sampler shapes and draws
    its rows: the bias (-inf where a token is banned) and three penalties in the slot's tables, its prompt marked,
    its counts zero."""
    import torch

    sampler = Sampler(64, max_penalty_slots=2, graph_tables=True)
    state = sampler.add_sequence(params, [1, 2, 2])
    assert state.graph_samples is graph
    if not graph:  # (a row the graph does not draw may still be tabled: its logprobs make it eager)
        return
    assert state.graph_shaped
    slot = state.penalty_slot
    assert slot is not None and state.tabled
    assert sampler.slot_params[slot].tolist() == pytest.approx(
        [params.repetition_penalty, params.frequency_penalty, params.presence_penalty, params.min_tokens])
    bans = sorted(params.min_tokens_banned)
    assert sampler.slot_bans[slot].tolist() == bans + [-1] * (sampler.slot_bans.shape[1] - len(bans))
    want = torch.zeros(64)
    for token, bias in (params.logit_bias or {}).items():
        want[token] = bias
    if params.allowed_token_ids is not None:
        banned = torch.ones(64, dtype=torch.bool)
        banned[list(params.allowed_token_ids)] = False
        want[banned] = float("-inf")
    for (token,) in params.bad_words:
        want[token] = float("-inf")
    assert torch.equal(sampler.bias_table[slot], want)
    # the eager path shapes the row as the tables do
    logits = torch.randn(1, 64)
    x = logits[0] + want
    if params.uses_penalties:
        seen = torch.zeros(64, dtype=torch.bool)
        seen[[1, 2]] = True
        x = torch.where(seen, torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty), x)
    x[bans] = float("-inf")
    assert torch.equal(sampler.apply_bias_and_penalties(logits, [state])[0], x)
    if params.penalty_last_n:  # the window's counts hold the prompt's last N tokens; the ring them, where it slides
        assert sampler.output_counts[slot].tolist()[:3] == [0, 1, 2] and not sampler.prompt_mask[slot].any()
        assert state.ring_window == (64 if params.penalty_last_n == 64 else 0)
        assert int(sampler.slot_window[slot]) == state.ring_window and int(sampler.slot_lens[slot]) == 3
        if state.ring_window:
            assert sampler.ring[slot, :3].tolist() == [1, 2, 2]
    else:
        assert sampler.prompt_mask[slot].nonzero().flatten().tolist() == [1, 2]
        assert not sampler.output_counts[slot].any()
    tables = sampler.shape_tables()
    assert tables.prompt.dtype == torch.uint8 and tables.bias.data_ptr() == sampler.bias_table.data_ptr()
    sampler.release(state)
    again = sampler.add_sequence(SamplingParams(temperature=0.8, logit_bias={5: 1.0}), [])  # the slot, reset
    assert again.penalty_slot == slot and sampler.bias_table[slot].nonzero().flatten().tolist() == [5]
    assert not sampler.prompt_mask[slot].any()


def test_without_graph_tables_logit_bias_takes_no_slot():
    state = Sampler(64, max_penalty_slots=1).add_sequence(SamplingParams(temperature=0.8, logit_bias={3: 2.0}), [1])
    assert state.penalty_slot is None and not state.tabled and not state.graph_samples


@pytest.mark.parametrize("params, replayable, position_only, graph_drawable", [
    (SamplingParams(temperature=0.0), True, True, True),
    (SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=3), True, True, True),
    (SamplingParams(temperature=0.8, top_k=40, sampler_order=LLAMA_CPP_ORDER), True, True, True),
    (SamplingParams(temperature=0.8, min_p=0.05, logit_bias={3: 2.0}), True, True, False),
    (SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, seed=5), True, True, True),
    (SamplingParams(temperature=0.8, xtc_probability=0.5, xtc_threshold=0.05), True, True, False),
    (SamplingParams(temperature=0.8, min_tokens=3, min_tokens_banned=frozenset({1}), max_tokens=8), True, True,
     False),
    (SamplingParams(temperature=0.8, top_p=0.95, sampler_order=LLAMA_CPP_ORDER), True, True, True),
    (SamplingParams(temperature=0.8, logprobs=2), True, True, False),
    (SamplingParams(temperature=0.8, repetition_penalty=1.2, frequency_penalty=1.5, seed=4), True, False, False),
    (SamplingParams(temperature=0.0, frequency_penalty=1.0), True, False, False),
    # llama.cpp's window: three tokens, prompt included, so the tokens drawn ahead push out the prompt's and
    # then their own
    (SamplingParams(temperature=0.8, repetition_penalty=2.0, presence_penalty=1.0, penalty_last_n=3, seed=2), True,
     False, False),
    # bad words and DRY read the history, which a drawn-ahead copy extends with the tokens in between
    (SamplingParams(temperature=0.0, bad_words=((7, 7), (11,))), True, False, False),  # 7 never twice running
    (SamplingParams(temperature=0.8, dry_multiplier=3.0, dry_allowed_length=1, seed=6), True, False, False),
    # a thinking budget: open from the start; after 3 tokens (or none) only the end marker (13) until it is drawn
    (SamplingParams(temperature=0.0, thinking_budget=3, thinking_end=13), True, False, False),
    (SamplingParams(temperature=0.0, thinking_budget=0, thinking_end=13), True, False, False),
    (SamplingParams(temperature=0.8, mirostat=2), False, False, False),
    (SamplingParams(temperature=0.8, adaptive_target=0.5, sampler_order=("temperature", "adaptive_p")), False,
     False, False),
])
def test_which_requests_speculative_steps_can_verify(params, replayable, position_only, graph_drawable):
    """replayable: every draw is a function of its position's logits, the seed, the draw count and what the tokens
    before it are (penalty counts, bad words' and DRY's history, a thinking budget), so a speculative step may
    draw at every fed position (the CPU executor); position_only: none of those; graph_drawable: also one the
    decode graph's sampler takes at every position (the GPU executor). A state drawn ahead with at_position,
    given the tokens in between, draws what it draws when it gets there, and changes nothing; advance then leaves
    it as drawing did. at_position refuses any other. The rows' logits are one peaked row, so a drawn-ahead row
    that did not see the tokens in between would repeat what the state would not."""
    import torch

    assert params.replayable is replayable and params.position_only is position_only
    assert params.graph_drawable is graph_drawable
    sampler = Sampler(64)
    state = sampler.add_sequence(params, [1, 2, 3])
    row = torch.zeros(64)
    row[[7, 9, 11, 13]] = torch.tensor([5.0, 4.6, 4.3, 4.0])
    rows = row.expand(8, 64).contiguous()
    if not replayable:
        with pytest.raises(ValueError):
            sampler.at_position(state, [1])
        return
    one_by_one = [int(sampler.sample(rows[j:j + 1], [state]).token_ids[0]) for j in range(8)]  # plain decoding
    fresh = sampler.add_sequence(params, [1, 2, 3])
    fresh.seed = state.seed
    before = (sampler.output_counts.clone(), sampler.prompt_mask.clone(),
              None if fresh.history is None else fresh.history.clone(),
              None if fresh.thinking_open is None else fresh.thinking_open.clone())
    ahead = [sampler.at_position(fresh, one_by_one[:j]) for j in range(8)]
    if graph_drawable:
        assert all(s.graph_samples for s in ahead)
    assert sampler.sample(rows, ahead).token_ids.tolist() == one_by_one
    assert fresh.num_output_tokens == 0 and fresh.history_len == state.history_len - 8 * (fresh.history is not None)
    assert torch.equal(before[0], sampler.output_counts) and torch.equal(before[1], sampler.prompt_mask)
    assert before[2] is None or torch.equal(before[2], fresh.history)
    assert before[3] is None or torch.equal(before[3], fresh.thinking_open)
    sampler.advance(fresh, one_by_one)
    assert fresh.num_output_tokens == state.num_output_tokens == 8
    if fresh.penalty_slot is not None:
        assert torch.equal(sampler.output_counts[fresh.penalty_slot], sampler.output_counts[state.penalty_slot])
    if fresh.history is not None:
        assert torch.equal(fresh.history, state.history) and fresh.history_len == state.history_len
    if fresh.thinking_open is not None:
        assert bool(fresh.thinking_open) == bool(state.thinking_open)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_a_window_kept_in_the_ring_counts_as_the_history_does(window):
    """The eager path of a Sampler keeping graph tables advances a tabled window's ring (as a graph's sampler
    does) instead of reading its history; its counts and greedy tokens stay those of a Sampler without tables."""
    import torch

    g = torch.Generator().manual_seed(window)
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0, presence_penalty=0.5, frequency_penalty=0.25,
                            penalty_last_n=window, max_tokens=40)
    tables, plain = Sampler(16, max_penalty_slots=1, graph_tables=True), Sampler(16, max_penalty_slots=1)
    prompt = [3, 4, 3, 5]
    a, b = tables.add_sequence(params, prompt), plain.add_sequence(params, prompt)
    assert a.tabled and a.ring_window == window and not b.tabled
    for step in range(30):
        logits = torch.randn(1, 16, generator=g) + torch.linspace(2.0, 0.0, 16)  # low ids likelier
        got, want = tables.sample(logits, [a]).token_ids, plain.sample(logits, [b]).token_ids
        assert torch.equal(got, want), step
        assert torch.equal(tables.output_counts[0], plain.output_counts[0]), step
        assert int(tables.output_counts[0].sum()) == min(window, len(prompt) + step + 1)


def test_a_gpu_step_sorts_its_rows_once():
    """graph_step_rows: which of a step's rows the graph draws (shaping some from the tables, taking logprobs
    beside others) and which the torch Sampler draws after it; rows that sample nothing or have no state are in
    none."""
    from flared.model.sampling import graph_step_rows

    sampler = Sampler(64, max_penalty_slots=4, graph_tables=True)
    params = [SamplingParams(temperature=0.8, top_p=0.9),  # the graph, as it is
              SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=2),  # the graph, shaped, logprobs
              SamplingParams(temperature=0.8, typical_p=0.9),  # the torch Sampler
              SamplingParams(temperature=0.8, logit_bias={3: 1.0}),  # the graph, shaped; not sampling this step
              SamplingParams(temperature=0.8, logprobs=0)]  # the graph, logprobs
    states = [sampler.add_sequence(p, [1, 2]) for p in params] + [None]
    flags = [True, True, True, False, True, True]
    in_graph, shaped, eager, logprobs = graph_step_rows(states, flags)
    assert in_graph == [True, True, False, False, True, False]
    assert (shaped, eager, logprobs) == ([1], [2], [1, 4])
