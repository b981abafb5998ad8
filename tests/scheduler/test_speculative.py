"""Speculative decoding by prompt lookup (SchedulerConfig.speculative_tokens, the eager executor's SPECULATIVE steps).

The scheduler proposes drafts from where a request's latest tokens occurred before in its prompt and output, only
for requests admitted with ``speculate`` and only with nothing in flight; a speculative completion keeps the
confirmed drafts and the step's own token, rolls back the rest, and is validated like every other record. End to
end (the scheduler, the eager executor, the model thread) the tokens are exactly those of plain decoding, in fewer
steps, for greedy requests beside sampled ones.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
import torch

from flared.errors import ExecutionError
from flared.scheduler import CompletionRecords, GraphKind, PolicyConfig, RequestScheduler, SchedulerConfig


def _scheduler(spec=3, **kw):
    return RequestScheduler(SchedulerConfig(model_identity=hashlib.sha256(b"spec").digest(), max_live_requests=4,
                                            num_pages=64, num_snapshots=16, page_tokens=16, context_capacity=256,
                                            prefill_chunk_size=64, speculative_tokens=spec, **kw), PolicyConfig())


def _prefill(s, prompt, first_token, max_tokens=10, speculate=True, prediction=()):
    """Admit ``prompt`` and run its prefill step, which samples ``first_token``; returns the handle."""
    h = s.admit(prompt, max_tokens, 1, speculate=speculate, prediction=prediction)
    now = 2
    while True:
        plan = s.plan(now)
        fence = s.last_committed_fence + 1
        s.commit(plan, fence)
        tokens = [first_token if x else -1 for x in plan.sample]
        s.complete(fence, _records(plan, tokens), 1000, now)
        now += 1
        if s.request(h).num_generated_tokens:
            return h


def _records(plan, tokens, accepted=None):
    starts = np.asarray(plan.token_starts, dtype=np.int64)
    kept = np.asarray([len(a) for a in accepted], dtype=np.int64) if accepted is not None else None
    consumed = starts + (1 + kept if kept is not None else np.asarray(plan.num_tokens, dtype=np.int64))
    generated = np.asarray(plan.generated_ends, dtype=np.int64) + (kept if kept is not None else 0)
    return CompletionRecords(handles=np.asarray(plan.handles, dtype=np.int64), consumed_tokens=consumed,
                             generated_tokens=generated, token_ids=np.asarray(tokens, dtype=np.int64),
                             accepted_drafts=accepted)


def test_drafts_come_from_an_earlier_occurrence_and_the_kept_ones_are_emitted():
    s = _scheduler(spec=3)
    # prompt + the first token: 1 5 6 7 8 9 5 6 7 | 8: its last four tokens "5 6 7 8" occur at 1, followed by 9
    h = _prefill(s, [1, 5, 6, 7, 8, 9, 5, 6, 7], first_token=8)
    plan = s.plan(10)
    assert plan.kind == GraphKind.SPECULATIVE
    assert list(plan.tokens(0)) == [8, 9]  # one draft first
    assert list(plan.positions(0)) == [9, 10]
    fence = s.last_committed_fence + 1
    s.commit(plan, fence)
    done = s.complete(fence, _records(plan, [5], accepted=[(9,)]), 1000, 11)
    assert done.emitted == [(h, 9), (h, 5)]
    assert s.request(h).spec_cap == 2  # all kept: twice as many next time
    # ... 7 8 9 5: "7 8 9 5" occurs at 3, followed by 6 7
    plan = s.plan(12)
    assert list(plan.tokens(0)) == [5, 6, 7] and plan.token_capacity == 3
    fence = s.last_committed_fence + 1
    s.commit(plan, fence)
    done = s.complete(fence, _records(plan, [42], accepted=[(6,)]), 1000, 13)
    assert done.emitted == [(h, 6), (h, 42)]
    r = s.request(h)
    assert r.num_computed_tokens == r.num_scheduled_tokens == 13  # 9 prompt, then 8 9, then 5 6
    assert r.num_generated_tokens == r.num_scheduled_samples == 5
    assert list(r.output_tokens) == [8, 9, 5, 6, 42]
    assert s.counters["speculative_drafted"] == 3 and s.counters["speculative_accepted"] == 2
    assert s.counters["speculative_rounds"] == 2 and s.counters["generation_rounds"] == 2
    # the next step feeds the step's own token from the position after the kept drafts
    plan = s.plan(14)
    assert plan.token_starts[0] == 13 and plan.tokens(0)[0] == 42
    s.check_integrity()


def test_drafts_stop_at_the_output_limit_and_need_speculate_and_a_match():
    s = _scheduler(spec=8)
    h = _prefill(s, [3, 4, 3, 4, 3], first_token=4, max_tokens=3)
    plan = s.plan(10)
    # two more outputs allowed: one draft and the step's own token
    assert plan.kind == GraphKind.SPECULATIVE and plan.num_tokens[0] == 2
    fence = s.last_committed_fence + 1
    s.commit(plan, fence)
    done = s.complete(fence, _records(plan, [3], accepted=[(3,)]), 1000, 11)
    assert done.emitted == [(h, 3), (h, 3)] and done.finished == [h]

    s = _scheduler(spec=4)
    _prefill(s, [3, 4, 3, 4, 3], first_token=4, speculate=False)
    assert s.plan(10).kind == GraphKind.DECODE  # not admitted for speculation
    s = _scheduler(spec=4)
    _prefill(s, [1, 2, 3, 4, 5], first_token=6)
    assert s.plan(10).kind == GraphKind.DECODE  # nothing to look up
    s = _scheduler(spec=0)
    _prefill(s, [3, 4, 3, 4, 3], first_token=4)
    assert s.plan(10).kind == GraphKind.DECODE  # off


def test_a_request_whose_drafts_fail_drafts_less_then_rests():
    """One draft first; kept all: the cap doubles (1 -> 2 -> 4, the most); kept none: it halves (4 -> 2 -> 1 -> 0),
    then SPECULATIVE_COOLDOWN plain rounds, then one draft again."""
    from flared._fast.scheduler import SPECULATIVE_COOLDOWN

    s = _scheduler(spec=4)
    h = _prefill(s, [3, 4] * 10, first_token=3, max_tokens=100)
    now = 10

    def step(accept_all: bool):
        nonlocal now
        plan = s.plan(now)
        fence = s.last_committed_fence + 1
        s.commit(plan, fence)
        drafts = tuple(int(t) for t in plan.tokens(0)[1:])
        kept = drafts if accept_all else ()
        token = 4 if (s.request(h).output_tokens[-1] if not kept else kept[-1]) == 3 else 3  # keep "3 4" going
        records = _records(plan, [token], accepted=[kept]) if plan.kind == GraphKind.SPECULATIVE else \
            _records(plan, [token])
        s.complete(fence, records, 1000, now)
        now += 1
        return len(drafts)

    assert [step(True) for _ in range(4)] == [1, 2, 4, 4]
    assert [step(False) for _ in range(3)] == [4, 2, 1]
    assert s.request(h).spec_cap == 0
    assert [step(False) for _ in range(SPECULATIVE_COOLDOWN)] == [0] * SPECULATIVE_COOLDOWN
    assert [step(True) for _ in range(4)] == [1, 2, 4, 4]


def _lookup(seq, cap, longest=4, shortest=2):
    """The prompt lookup the scheduler does, written plainly: the latest n tokens (n from longest down) found
    earlier; the latest such place followed by cap tokens, else the earliest; what follows it."""
    L = len(seq)
    for n in range(min(longest, L - 1), shortest - 1, -1):
        hits = [h for h in range(L - n) if seq[h:h + n] == seq[L - n:]]
        if hits:
            full = [h for h in hits if h + n + cap <= L]
            i = (full[-1] if full else hits[0]) + n
            return seq[i:i + cap]
    return []


@pytest.mark.parametrize("seed", range(12))
def test_drafts_are_the_plain_prompt_lookup(seed):
    """Random prompts over a few symbols, every draft kept (the cap climbs 1, 2, 4, 8): each step's drafts are
    what the plain lookup above gives for the request's tokens so far."""
    rng = np.random.default_rng(seed)
    s = _scheduler(spec=8)
    prompt = [int(t) for t in rng.integers(0, 3 + seed % 3, size=int(rng.integers(6, 40)))]
    h = _prefill(s, prompt, first_token=int(rng.integers(0, 3)), max_tokens=60)
    seen = _keep_every_draft(s, h, rng, 3, lambda r, cap: _lookup(prompt + list(r.output_tokens), cap))
    assert seen


def _keep_every_draft(s, h, rng, symbols: int, want) -> int:
    """Run request ``h`` to its end, each step's own token random over ``symbols`` and every draft kept, checking
    each step's drafts against ``want(request, cap)`` ([] where the cap is 0); how many steps had drafts."""
    now, seen, finished = 10, 0, False
    while not finished:
        r = s.request(h)
        cap = min(r.spec_cap, r.max_output_tokens - r.num_scheduled_samples - 1)
        plan = s.plan(now)
        drafts = [int(t) for t in plan.tokens(0)[1:]]
        assert drafts == (want(r, cap) if cap > 0 else [])
        seen += bool(drafts)
        fence = s.last_committed_fence + 1
        s.commit(plan, fence)
        token = int(rng.integers(0, symbols))
        if plan.kind == GraphKind.SPECULATIVE:
            done = s.complete(fence, _records(plan, [token], accepted=[tuple(drafts)]), 1000, now)
        else:
            done = s.complete(fence, _records(plan, [token]), 1000, now)
        finished = h in done.finished
        now += 1
    return seen


def _predicted_lookup(prediction, seq, outputs, cap, longest=4, shortest=2):
    """The lookup in a predicted output, written plainly: the output's latest n tokens (n from longest down to
    shortest, or to 1 while the output is shorter; at most its length) found in the prediction with a token after
    them, at the place nearest the output's own position (the earlier on a tie); what follows. None: no match."""
    for n in range(min(longest, outputs), max(min(shortest, outputs), 1) - 1, -1):
        ends = [j for j in range(n - 1, len(prediction) - 1) if prediction[j - n + 1:j + 1] == seq[len(seq) - n:]]
        if ends:
            j = min(ends, key=lambda e: (abs(e - (outputs - 1)), e))
            return prediction[j + 1:j + 1 + cap]
    return None


def test_a_predicted_output_is_where_drafts_are_looked_up_first():
    """OpenAI's predicted outputs: drafts come from the prediction before the prompt, from the first output token on
    (a 1-token match while the output is shorter than the shortest n-gram); an output that follows the prediction
    is drafted whole, the cap climbing as drafts are kept. (The nearest-place rule: the randomized test below.)"""
    s = _scheduler(spec=4)
    prediction = [30, 31, 7, 8, 50, 51, 52, 7, 8, 60, 61, 62, 63]
    prompt = [1, 2, 3, 30, 31, 99]
    h = _prefill(s, prompt, first_token=30, max_tokens=len(prediction), prediction=prediction)
    now, caps, emitted = 10, [], [30]
    while True:
        plan = s.plan(now)
        r = s.request(h)
        k, cap = len(r.output_tokens), min(r.spec_cap, r.max_output_tokens - r.num_scheduled_samples - 1)
        drafts = tuple(int(t) for t in plan.tokens(0)[1:])
        assert list(drafts) == prediction[k:k + cap]  # (the prompt's "30 31" would have given 99 first)
        caps.append(cap)
        fence = s.last_committed_fence + 1
        s.commit(plan, fence)
        token = prediction[k + len(drafts)]  # the model writes what was predicted
        done = s.complete(fence, _records(plan, [token], accepted=[drafts]), 1000, now)
        emitted += [t for handle, t in done.emitted if handle == h]
        now += 1
        if h in done.finished:
            break
    assert caps[:3] == [1, 2, 4] and len(caps) == 4 and emitted == prediction


@pytest.mark.parametrize("seed", range(8))
def test_drafts_are_the_plain_predicted_lookup_then_the_prompt_lookup(seed):
    """Random prompts, predictions and outputs over a few symbols, every draft kept: each step's drafts are the
    plain predicted lookup's, or where it finds nothing the plain prompt lookup's."""
    rng = np.random.default_rng(100 + seed)
    s = _scheduler(spec=8)
    prompt = [int(t) for t in rng.integers(0, 4, size=int(rng.integers(6, 30)))]
    prediction = [int(t) for t in rng.integers(0, 4, size=int(rng.integers(1, 40)))]
    h = _prefill(s, prompt, first_token=int(rng.integers(0, 4)), max_tokens=50, prediction=prediction)

    def want(r, cap):
        out = list(r.output_tokens)
        return _predicted_lookup(prediction, prompt + out, len(out), cap) or _lookup(prompt + out, cap)

    _keep_every_draft(s, h, rng, 4, want)


@pytest.mark.parametrize("base_ns, per_token_ns, drafts_priced", [(10_000_000, 100_000, False),
                                                                   (100_000, 10_000_000, True)])
def test_drafts_are_priced_by_what_a_fed_token_costs(base_ns, per_token_ns, drafts_priced):
    """The steps take base + per token fed. Every draft is kept, so the cap climbs to 4 and the tokens fed vary
    (RowCost's fit). Where a token fed costs 1% of a step, drafts stay; where it costs 100 times the step's base,
    a draft (even one kept 4 times in 5) costs more time than it saves on average: the step decodes plainly
    and counts the drafts it left out."""
    s = _scheduler(spec=4)
    h = _prefill(s, [3, 4] * 10, first_token=3, max_tokens=200)
    now = 10
    kinds = []
    for _ in range(8):
        plan = s.plan(now)
        kinds.append(plan.kind)
        fence = s.last_committed_fence + 1
        s.commit(plan, fence)
        drafts = tuple(int(t) for t in plan.tokens(0)[1:])
        last = drafts[-1] if drafts else s.request(h).output_tokens[-1]
        token = 4 if last == 3 else 3
        fed = int(sum(plan.num_tokens))
        records = (_records(plan, [token], accepted=[drafts]) if plan.kind == GraphKind.SPECULATIVE
                   else _records(plan, [token]))
        s.complete(fence, records, base_ns + per_token_ns * fed, now)
        now += 1
    a, b = s.row_cost.fit()
    assert b == pytest.approx(per_token_ns, rel=1e-6) and a == pytest.approx(base_ns, rel=1e-6)
    assert kinds[:3] == [GraphKind.SPECULATIVE] * 3  # 1, 2, 4 drafts: no fit before the tokens fed varied
    if drafts_priced:
        assert kinds[-1] == GraphKind.DECODE and s.counters["speculative_priced_out"] > 0
    else:
        assert set(kinds) == {GraphKind.SPECULATIVE} and s.counters["speculative_priced_out"] == 0


def test_speculative_max_rows_caps_a_steps_tokens_and_a_cohort_that_fills_it_decodes_plainly():
    """speculative_max_rows (the CUDA graph executor's largest speculative graph): with 2, a lone request whose
    cap has widened to two drafts still feeds one (its last token and one draft fill the step), and a cohort of
    two decodes plainly."""
    for max_rows, second in ((0, [5, 6, 7]), (2, [5, 6])):
        s = _scheduler(spec=3, speculative_max_rows=max_rows)
        h = _prefill(s, [1, 5, 6, 7, 8, 9, 5, 6, 7], first_token=8)
        plan = s.plan(10)
        assert plan.kind == GraphKind.SPECULATIVE and list(plan.tokens(0)) == [8, 9]
        s.commit(plan, s.last_committed_fence + 1)
        s.complete(s.last_committed_fence, _records(plan, [5], accepted=[(9,)]), 1000, 11)
        assert s.request(h).spec_cap == 2
        plan = s.plan(12)
        assert plan.kind == GraphKind.SPECULATIVE and list(plan.tokens(0)) == second
    s = _scheduler(spec=3, speculative_max_rows=2)
    handles = [s.admit(p, 40, 1, speculate=True) for p in ([1, 5, 6, 7, 8, 9, 5, 6, 7], [2, 5, 6, 7, 8, 9, 5, 6, 7])]
    now = 2
    while not all(s.request(h).num_generated_tokens for h in handles):
        plan = s.plan(now)
        fence = s.last_committed_fence + 1
        s.commit(plan, fence)
        spec = plan.kind == GraphKind.SPECULATIVE  # the first request alone, while the second one's prefill waits
        s.complete(fence, _records(plan, [8 if x else -1 for x in plan.sample],
                                   accepted=[()] * plan.num_participants if spec else None), 1000, now)
        now += 1
    plan = s.plan(now)
    assert plan.kind == GraphKind.DECODE and plan.num_participants == 2
    s.commit(plan, s.last_committed_fence + 1)
    s.complete(s.last_committed_fence, _records(plan, [8, 8]), 1000, now)
    # the pair fills the step, so their decodes stack behind one in flight, past any miss's rest (no window
    # drains for drafts they cannot have)
    inflight = s.plan(now + 1)
    s.commit(inflight, s.last_committed_fence + 1)
    for k in range(12):
        nxt = s.plan(now + 2 + 2 * k)
        assert nxt is not None and nxt.kind == GraphKind.DECODE and nxt.num_participants == 2
        s.commit(nxt, s.last_committed_fence + 1)
        s.complete(s.last_committed_fence - 1, _records(inflight, [8, 8]), 1000, now + 3 + 2 * k)
        inflight = nxt
    assert all(s.request(h).spec_rest == 0 for h in handles)


def test_a_step_in_flight_drains_for_speculation_until_the_lookup_comes_up_empty():
    """With a decode in flight, a decode cohort would stack behind it (pipelined), but drafts need every token on
    the host: a request that may speculate lets the window drain instead, unless a recent round's lookup found
    it no draft. Such a miss lets SPECULATIVE_MISS_REST stacked rounds go by first. Without speculation decodes
    always stack."""
    from flared._fast.scheduler import SPECULATIVE_MISS_REST

    def stacked_rounds(s, h, limit=40):
        """Rounds that stacked behind the one in flight before a plan drained the window (up to ``limit``)."""
        first = s.plan(10)  # the window is empty: speculation (if on) looks up drafts, finds none
        s.commit(first, s.last_committed_fence + 1)
        inflight, now, rounds = first, 11, 0
        while rounds < limit:
            nxt = s.plan(now)
            if nxt is None:
                break
            assert nxt.kind == GraphKind.DECODE and not nxt.spec_tried
            s.commit(nxt, s.last_committed_fence + 1)
            s.complete(s.last_committed_fence - 1, _records(inflight, [8]), 1000, now + 1)
            inflight, now, rounds = nxt, now + 2, rounds + 1
        return rounds

    for spec, want in ((3, SPECULATIVE_MISS_REST), (0, 40)):
        s = _scheduler(spec=spec)
        h = _prefill(s, [1, 2, 3, 4, 5], first_token=6, max_tokens=100)  # nothing to look up
        warm = s.plan(10)  # one decode round measures the decode shape (unmeasured shapes never stack)
        s.commit(warm, s.last_committed_fence + 1)
        s.complete(s.last_committed_fence, _records(warm, [7]), 1000, 10)
        # one round stacks while the first plan's lookup is in flight (the warm round missed), then the rest
        assert stacked_rounds(s, h) == (want if spec == 0 else want + 1)
        if spec:
            assert s.request(h).spec_rest == 0


def test_bad_speculative_records_are_refused_before_anything_changes():
    s = _scheduler(spec=3)
    h = _prefill(s, [1, 5, 6, 7, 8, 9, 5, 6, 7], first_token=8)
    plan = s.plan(10)
    fence = s.last_committed_fence + 1
    s.commit(plan, fence)
    with pytest.raises(ExecutionError, match="no accepted drafts"):
        s.complete(fence, _records(plan, [42]), 1000, 11)
    with pytest.raises(ExecutionError, match="drafts kept"):
        s.complete(fence, _records(plan, [42], accepted=[(9, 5)]), 1000, 11)
    bad = _records(plan, [42], accepted=[(9,)])._replace(consumed_tokens=np.asarray([13], dtype=np.int64))
    with pytest.raises(ExecutionError, match="consumed 13"):
        s.complete(fence, bad, 1000, 11)
    assert s.request(h).num_generated_tokens == 1 and len(s.request(h).output_tokens) == 1
    done = s.complete(fence, _records(plan, [42], accepted=[()]), 1000, 11)  # no draft kept: one token, as decode
    assert done.emitted == [(h, 42)] and s.request(h).num_computed_tokens == 10


def test_config_bounds():
    with pytest.raises(ValueError, match="speculative_tokens"):
        _scheduler(spec=17)
    with pytest.raises(ValueError, match="prompt_lookup"):
        _scheduler(spec=2, prompt_lookup_min=3, prompt_lookup_max=2)


def _drive(tiny_hf_llama, spec, prompts, params):
    """The requests through the scheduler and the eager executor. Each step's duration is modelled from the tokens
    it feeds (2 ms + 50 us a token) in place of the host's measured time, and the scheduler's clock advances by
    it: the policy prices drafts from step durations, so on a loaded machine measured times would change which
    drafts are fed (the tokens would not change; the step counts the tests compare would)."""
    from flared.execution.eager import EagerExecutor
    from flared.execution.offline import drive
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    clock = [0]

    class ModelledTime(EagerExecutor):
        def run(self, plan, tables, states):
            records, _measured, *rest = super().run(plan, tables, states)
            duration = 2_000_000 + 50_000 * int(np.sum(plan.num_tokens))
            clock[0] += duration
            return (records, duration, *rest)

    src = read_source(tiny_hf_llama)
    model = DecoderModel(src.config, src.tensors, dtype=torch.float32, device="cpu", max_positions=256)
    s = _scheduler(spec=spec)
    ex = ModelledTime(model, num_pages=64, page_tokens=16, num_state_rows=5, num_snapshots=16,
                      vocab_size=src.config.vocab_size, max_live=4)
    return drive(s, ex, prompts, params, speculate=True, clock_ns=lambda: clock[0]), s


def test_speculative_steps_give_the_tokens_of_plain_decoding(tiny_hf_llama):
    """A repetitive prompt (drafts found and kept), a plain one and a seeded mirostat request (never speculated:
    its running bound follows each earlier draw's distribution; it rides in the speculative steps as in a decode
    step): every token as without speculation, in fewer steps."""
    from flared.model.sampling import SamplingParams

    prompts = [[11, 12, 13, 14, 15, 16] * 8, list(range(20, 70)), [7, 8, 9]]
    params = [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0, max_tokens=30),
              SamplingParams(temperature=0.9, mirostat=2, seed=5, max_tokens=25)]
    plain, _ = _drive(tiny_hf_llama, 0, prompts, params)
    fast, s = _drive(tiny_hf_llama, 4, prompts, params)
    assert fast.tokens == plain.tokens
    assert [len(t) for t in fast.tokens] == [40, 30, 25]
    assert fast.steps_by_kind["SPECULATIVE"] > 0 and s.counters["speculative_accepted"] > 0
    decode_steps = lambda r: r.steps_by_kind["DECODE"] + r.steps_by_kind["SPECULATIVE"]  # noqa: E731
    assert decode_steps(fast) < decode_steps(plain)


def test_sampled_requests_speculate_and_draw_what_plain_decoding_draws(tiny_hf_llama):
    """Seeded sampled requests (temperature, top-k, top-p, min-p, a logit bias) feed drafts too: each fed row draws
    with its own position's draw count, a draft is kept where the draw equals it, and the tokens are plain
    decoding's, draw for draw. Some drafts are kept, some not, and the draws are not the argmax. (The tiny random
    model's logits spread about 0.2 where a trained model's spread several units: its temperatures are scaled to
    match, or no draft would ever be drawn.)"""
    from flared.model.sampling import SamplingParams

    prompts = [[11, 12, 13, 14, 15, 16] * 8, [30, 31, 32, 33] * 10, list(range(20, 70))]
    params = [SamplingParams(temperature=0.02, seed=3, max_tokens=40),
              SamplingParams(temperature=0.02, top_k=4, top_p=0.9, seed=8, max_tokens=40),
              SamplingParams(temperature=0.02, min_p=0.05, logit_bias={5: 0.1}, seed=1, max_tokens=30)]
    plain, _ = _drive(tiny_hf_llama, 0, prompts, params)
    fast, s = _drive(tiny_hf_llama, 4, prompts, params)
    assert fast.tokens == plain.tokens
    assert s.counters["speculative_accepted"] > 0
    assert s.counters["speculative_drafted"] > s.counters["speculative_accepted"]
    greedy, _ = _drive(tiny_hf_llama, 0, prompts, [dataclasses.replace(p, temperature=0.0) for p in params])
    assert greedy.tokens != plain.tokens


def test_requests_with_penalties_speculate_and_count_the_drafts_before_each_row(tiny_hf_llama):
    """Repetition, frequency and presence penalties, over the whole output (vLLM's) or a window of the last 8
    tokens (llama.cpp's repeat_last_n): each fed row's penalties count the drafts before it, so the tokens are
    plain decoding's; drafts are kept and rejected."""
    from flared.model.sampling import SamplingParams

    prompts = [[11, 12, 13, 14, 15, 16] * 8, [30, 31, 32, 33] * 10, [11, 12, 13, 14, 15, 16] * 6]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.1, penalty_last_n=8,
                             max_tokens=40),
              SamplingParams(temperature=0.02, repetition_penalty=1.3, frequency_penalty=0.1, presence_penalty=0.05,
                             penalty_last_n=8, seed=3, max_tokens=40),
              SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=40)]
    plain, _ = _drive(tiny_hf_llama, 0, prompts, params)
    fast, s = _drive(tiny_hf_llama, 4, prompts, params)
    assert fast.tokens == plain.tokens
    assert 0 < s.counters["speculative_accepted"] < s.counters["speculative_drafted"]


def test_requests_with_bad_words_dry_or_a_thinking_budget_speculate_too(tiny_hf_llama):
    """Bad words and DRY read the output so far, a thinking budget whether reasoning is still open: each fed row
    sees the drafts before it there too, so the tokens are plain decoding's, with drafts kept."""
    from flared.model.sampling import SamplingParams

    prompts = [[11, 12, 13, 14, 15, 16] * 8, [30, 31, 32, 33] * 10, [11, 12, 13, 14, 15, 16] * 6]
    plain_out, _ = _drive(tiny_hf_llama, 0, prompts, [SamplingParams(temperature=0.0, max_tokens=40)] * 3)
    loop = plain_out.tokens[0][:3]  # what the first request repeats: ban one of its pairs, end thinking on another
    params = [SamplingParams(temperature=0.0, bad_words=((loop[0], loop[1]),), max_tokens=40),
              SamplingParams(temperature=0.02, dry_multiplier=0.05, dry_allowed_length=3, seed=3, max_tokens=40),
              SamplingParams(temperature=0.0, thinking_budget=6, thinking_end=loop[2], max_tokens=40)]
    plain, _ = _drive(tiny_hf_llama, 0, prompts, params)
    fast, s = _drive(tiny_hf_llama, 4, prompts, params)
    assert fast.tokens == plain.tokens
    assert plain.tokens != plain_out.tokens  # the settings change what is drawn
    assert s.counters["speculative_accepted"] > 0


def test_the_model_thread_speculates_for_greedy_and_sampled_requests(tiny_core):
    """ModelRuntime(speculative=...): greedy and seeded sampled requests get the same tokens and stop strings/EOS
    as without; requests with logprobs speculate too, and every token, kept draft or not, comes with the
    log-probabilities plain decoding gives it. Served together, then one at a time: a lone stream keeps its
    drafts whatever the step times (in a cohort of four, the pricing may leave them all out: it follows
    measured step times)."""
    from flared.core.load import open_core
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import FinishEvent, GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    prompt = tuple([40, 41, 42, 43, 44] * 10)
    requests = [GenerateRequest(prompt, (), SamplingParams(max_tokens=32, temperature=0.0), frozenset({2})),
                GenerateRequest(prompt, (), SamplingParams(max_tokens=32, temperature=0.0, logprobs=2),
                                frozenset({2})),
                GenerateRequest(prompt[3:], (), SamplingParams(max_tokens=32, temperature=0.02, top_k=8, seed=9),
                                frozenset({2})),
                GenerateRequest(prompt, (), SamplingParams(max_tokens=32, temperature=0.01, seed=4, logprobs=3),
                                frozenset({2}))]

    def serve(speculative, together):
        rt = ModelRuntime(open_core(tiny_core), torch_threads=1, prefix_cache=False, speculative=speculative)
        rt.start(max_pending=8)
        try:
            if together:
                events = run_requests(rt, requests)
            else:
                events = [run_requests(rt, [r])[0] for r in requests]
            return events, dict(rt.scheduler.counters)
        finally:
            rt.stop()

    def same(plain, fast):
        for a, b in zip(plain, fast):
            assert [t for e in a if isinstance(e, TokenEvent) for t in e.token_ids] == \
                [t for e in b if isinstance(e, TokenEvent) for t in e.token_ids]
            assert isinstance(b[-1], FinishEvent) and b[-1].reason == a[-1].reason
        for i in (1, 3):
            got = [lp for e in fast[i] if isinstance(e, TokenEvent) for lp in e.logprobs]
            want = [lp for e in plain[i] if isinstance(e, TokenEvent) for lp in e.logprobs]
            assert len(got) == len(want) > 0
            for g, w in zip(got, want):
                assert g.token_id == w.token_id and [t for t, _ in g.top] == [t for t, _ in w.top]
                assert g.logprob == pytest.approx(w.logprob, abs=1e-5)

    same(serve((0, 4, 2), together=True)[0], serve((4, 4, 2), together=True)[0])
    fast, counters = serve((4, 4, 2), together=False)
    same(serve((0, 4, 2), together=False)[0], fast)
    assert counters["launches_speculative"] > 0 and counters["speculative_accepted"] > 0


def test_a_predicted_output_feeds_drafts_and_changes_no_token(tiny_core):
    """OpenAI's predicted outputs at the model thread: a greedy request whose prediction is its plain output gets
    the same tokens in fewer steps than speculation without it, its FinishEvent counting the drafts fed and kept;
    a prediction unlike the output changes no token either."""
    from flared.core.load import open_core
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import FinishEvent, GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    prompt = tuple(range(60, 100))

    def serve(speculative, prediction=()):
        rt = ModelRuntime(open_core(tiny_core), torch_threads=1, prefix_cache=False, speculative=speculative)
        rt.start(max_pending=4)
        try:
            (events,) = run_requests(rt, [GenerateRequest(prompt, (), SamplingParams(max_tokens=40, temperature=0.0),
                                                          frozenset(), prediction=tuple(prediction))])
            return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids], events[-1], \
                dict(rt.scheduler.counters)
        finally:
            rt.stop()

    tokens, end, _ = serve((0, 4, 2))
    assert len(tokens) == 40 and end.num_drafted == end.num_accepted_drafts == 0
    looked_up, end_lookup, lookup = serve((4, 4, 2))
    predicted, end_predicted, counters = serve((4, 4, 2), tokens)
    assert looked_up == predicted == tokens
    assert isinstance(end_predicted, FinishEvent) and end_predicted.num_accepted_drafts >= 30
    assert end_predicted.num_drafted >= end_predicted.num_accepted_drafts
    assert counters["speculative_accepted"] == end_predicted.num_accepted_drafts
    assert end_predicted.num_accepted_drafts > end_lookup.num_accepted_drafts
    assert counters["generation_rounds"] < lookup["generation_rounds"]
    unlike, _, _ = serve((4, 4, 2), [7, 8, 9] * 20)
    assert unlike == tokens


def test_server_config_and_flags_name_bad_values():
    from click.testing import CliRunner

    from flared.cli.daemon import main
    from flared.config import ConfigError, ServerConfig

    assert ServerConfig(speculative_tokens=4).speculative_tokens == 4
    with pytest.raises(ConfigError, match="speculative_tokens"):
        ServerConfig(speculative_tokens=17)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        ServerConfig(speculative_tokens=2, prompt_lookup_min=5)
    out = CliRunner().invoke(main, ["run", "--speculative-tokens", "-1", "--no-admin-socket"])
    assert out.exit_code == 2 and "speculative_tokens" in out.output
