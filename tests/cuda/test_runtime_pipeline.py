"""The model thread on the GPU with two decode frames in flight, against the same thread one step at a time.

A bf16 core of the tiny random-weight Llama served by two ModelRuntimes (pipeline on and off) on the
CUDA graph executor. Greedy, seeded sampling, penalties with logprobs, an early stop token, min_tokens and
allowed_token_ids give the same tokens either way, and the pipelined runtime really had two frames in flight.
"""

from __future__ import annotations

import json
import time

import pytest

torch = pytest.importorskip("torch")


def _run(runtime, requests):
    """(tokens, chosen-token logprobs) per request; an error fails the test."""
    from flared.runtime.request import ErrorEvent, TokenEvent
    from flared_testing.runtime import run_requests

    tokens, logprobs = [], []
    for i, events in enumerate(run_requests(runtime, requests)):
        assert not isinstance(events[-1], ErrorEvent), f"request {i}: {events[-1]}"
        tokens.append([t for e in events if isinstance(e, TokenEvent) for t in e.token_ids])
        logprobs.append([lp.logprob for e in events if isinstance(e, TokenEvent) and e.logprobs for lp in e.logprobs])
    return tokens, logprobs


def test_two_frames_in_flight_give_the_same_tokens(bf16_core):
    from flared.core.load import open_core
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import GenerateRequest
    from flared.runtime.worker import ModelRuntime

    def request(prompt, max_tokens=40, stop=frozenset(), **kw):
        return GenerateRequest(tuple(prompt), (), SamplingParams(max_tokens=max_tokens, **kw), frozenset(stop))

    prompts = [[5 + i, 17, 40 + 3 * i, 99, 7] * (2 + i) for i in range(4)]
    runtimes = {}
    for pipeline in (True, False):
        rt = ModelRuntime(open_core(bf16_core), pipeline=pipeline, prefix_cache=False)
        rt.start(max_pending=16)
        assert type(rt.executor).__name__ == "GraphExecutor"
        runtimes[pipeline] = rt
    try:
        greedy = [request(p, temperature=0.0) for p in prompts]
        first, _ = _run(runtimes[False], greedy[:1])
        stop_at = first[0][5]
        batch = greedy + [
            request(prompts[1], temperature=0.9, seed=11),
            request(prompts[2], temperature=0.8, top_k=20, top_p=0.9, seed=12),
            request(prompts[3], temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=2),
            request(prompts[0], temperature=0.0, stop={stop_at}),  # ends early, maybe with a step in flight
            # vLLM's min_tokens (the stop token banned for 8 tokens) and allowed_token_ids: eager-sampled rows
            request(prompts[0], temperature=0.0, stop={stop_at}, min_tokens=8, min_tokens_banned=frozenset({stop_at})),
            request(prompts[1], temperature=0.9, seed=13, allowed_token_ids=(5, 17, 99, 7)),
        ]
        got = {False: _run(runtimes[False], batch)}
        # Stacking is opportunistic: the scheduler stops stacking behind a frame that ran past its estimate,
        # and this tiny model's steps take tens of microseconds, so a slow host turn (a busy machine) can
        # keep a whole run at one frame. Every run must match; up to three runs to see two frames stack.
        for _attempt in range(3):
            got[True] = _run(runtimes[True], batch)
            assert got[True][0] == got[False][0]
            for a, b in zip(got[True][1], got[False][1]):
                assert a == pytest.approx(b, abs=1e-4)
            if runtimes[True].executor.max_outstanding == 2:
                break
        assert got[True][0][-3][-1] == stop_at and len(got[True][0][-3]) <= 6
        assert stop_at not in got[True][0][-2][:8] and len(got[True][0][-2]) >= 8
        assert set(got[True][0][-1]) <= {5, 17, 99, 7} and len(got[True][0][-1]) == 40
        assert runtimes[True].executor.max_outstanding == 2
        assert runtimes[False].executor.max_outstanding == 1
        for rt in runtimes.values():
            assert rt.snapshot()["outstanding"] == 0
            deadline = time.monotonic() + 10
            while rt.snapshot()["live_slots"] and time.monotonic() < deadline:
                time.sleep(0.01)  # terminal snapshots may still be retiring the last requests
            assert rt.snapshot()["live_slots"] == 0
    finally:
        for rt in runtimes.values():
            rt.stop()


def test_scored_prompts_on_the_gpu_runtime(bf16_core, tiny_hf_llama):
    """The model thread on the CUDA graph executor serves scored prompts (echo / prompt_logprobs): a whole prompt
    and a continuation, beside requests that generate in the same batches; scores close to transformers' float32
    log-softmax (bf16 core), the generating requests' tokens unchanged by the scored ones."""
    from transformers import LlamaForCausalLM

    from flared.core.load import open_core
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import FinishEvent, GenerateRequest, ScoredEvent, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    prompt = [40 + (7 * i) % 150 for i in range(150)]
    generate = [GenerateRequest(tuple(prompt[:20 + i]), (), SamplingParams(max_tokens=16, temperature=0.0),
                                frozenset()) for i in range(2)]
    scored = [GenerateRequest(tuple(prompt), (), SamplingParams(max_tokens=1, temperature=0.0), frozenset(),
                              score_from=first) for first in (1, 100)]
    # /v1/decisions' pattern: options scored as continuations of one prompt that ends at a message boundary; the
    # first option leaves a checkpoint there, the second restores it and scores from the restored state's logits
    options = [tuple(prompt[:90]) + tuple(o) for o in ((5, 6, 7), (9, 10))]
    decisions = [GenerateRequest(o, (90,), SamplingParams(max_tokens=1, temperature=0.0), frozenset(), score_from=90)
                 for o in options]
    rt = ModelRuntime(open_core(bf16_core), pipeline=True, prefix_cache=True)
    rt.start(max_pending=16)
    try:
        alone = run_requests(rt, generate)
        events = run_requests(rt, generate + scored)
        decided = run_requests(rt, decisions[:1]) + run_requests(rt, decisions[1:])
    finally:
        rt.stop()
    tokens = [[t for e in ev if isinstance(e, TokenEvent) for t in e.token_ids] for ev in alone]
    assert [[t for e in ev if isinstance(e, TokenEvent) for t in e.token_ids] for ev in events[:2]] == tokens
    model = LlamaForCausalLM.from_pretrained(tiny_hf_llama, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for request, ev in zip(scored, events[2:]):
        assert isinstance(ev[0], ScoredEvent) and isinstance(ev[-1], FinishEvent), ev
        want = [lp[p - 1, prompt[p]].item() for p in range(request.score_from, len(prompt))]
        assert list(ev[0].logprobs) == pytest.approx(want, abs=0.1)  # bf16 weights and activations
    assert rt.stats["launches_scored_prefill"] >= 1
    assert decided[1][-1].num_cached_tokens >= 80  # the second option restored the prompt
    for option, ev in zip(options, decided):
        assert isinstance(ev[0], ScoredEvent) and isinstance(ev[-1], FinishEvent), ev
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([option])).logits[0].float(), dim=-1)
        assert list(ev[0].logprobs) == pytest.approx([lp[p - 1, option[p]].item() for p in range(90, len(option))],
                                                     abs=0.1)
    assert type(rt.executor).__name__ == "GraphExecutor"


def test_grammar_rows_are_drawn_by_the_graphs(bf16_core, monkeypatch):
    """Grammar-constrained requests on the CUDA graph executor: their masks are staged in the Sampler's slot tables
    and drawn by graphs (no row sampled by the torch Sampler): by the draw_rows graph behind the step's graph, their
    masks computed while it ran (the default), each the same token as the step's graph's sampler draws with the
    masks staged before its launch (grammar_after off), seeded rows too. Greedy ones give the tokens the torch
    Sampler's masks give them (the same graph logits), sampled ones valid documents."""
    from tokenizers import Tokenizer

    from flared.core.load import open_core
    from flared.model.grammar import GrammarCompiler
    from flared.model.sampling import SamplingParams, SequenceSamplingState
    from flared.runtime.request import FinishEvent, GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    enum = {"enum": ["fox", "dog", "Paris", "hello world"]}
    records = {"type": "array", "minItems": 2, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "age"], "additionalProperties": False}}
    rt = ModelRuntime(open_core(bf16_core), pipeline=True, prefix_cache=False)
    rt.start(max_pending=16)
    core = rt.core
    tok = Tokenizer.from_file(str(bf16_core / core.manifest.tokenizer))
    eos = core.manifest.tokens.eos_token_ids
    compiler = GrammarCompiler((bf16_core / core.manifest.tokenizer).read_text(), vocab_size=core.config.vocab_size,
                               eos_token_ids=eos)
    prompt = tuple(tok.encode("<|im_start|>user\nPick one.<|im_end|>\n<|im_start|>assistant\n").ids)
    stop = frozenset(eos)

    def request(grammar=None, **kw):
        return GenerateRequest(prompt, (), SamplingParams(max_tokens=80, **kw), stop,
                               grammar=None if grammar is None else compiler.json_schema(grammar))

    batch = [request(enum, temperature=0.0), request(records, temperature=0.0), request(temperature=0.0),
             request(enum, temperature=1.0, seed=3), request(records, temperature=0.9, top_p=0.9, seed=4)]
    staged = []
    real_stage = rt.executor.sampler.stage_grammar_masks
    eager_rows = []
    real_eager = rt.executor._eager_sample
    apart = []
    real_apart = rt.executor._draw_grammar_rows

    def draw_apart(rows, *args):
        apart.append(len(rows))
        return real_apart(rows, *args)

    def stage(states):
        staged.append(len(states))
        return real_stage(states)

    def eager(logits, rows, *args, **kwargs):
        eager_rows.append(len(rows))
        return real_eager(logits, rows, *args, **kwargs)

    def tokens(events):
        assert isinstance(events[-1], FinishEvent), events[-1]
        return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]

    reasons = []

    def finished(events):
        reasons.append(events[-1].reason)
        return tokens(events)

    try:
        monkeypatch.setattr(rt.executor.sampler, "stage_grammar_masks", stage)
        monkeypatch.setattr(rt.executor, "_eager_sample", eager)
        assert rt.executor.grammar_after  # its draw_rows graphs captured
        monkeypatch.setattr(rt.executor, "_draw_grammar_rows", draw_apart)
        graph = [finished(ev) for ev in run_requests(rt, batch)]
        assert sum(staged) > 0 and not eager_rows  # every constrained row drawn by the graphs
        assert sum(apart) == sum(staged)  # ... behind the step's graph
        rt.executor.grammar_after = False
        del staged[:], apart[:]
        before = [tokens(ev) for ev in run_requests(rt, batch)]
        assert sum(staged) > 0 and not apart and not eager_rows  # by the step's graph itself
        assert before == graph
        rt.executor.grammar_after = True
        monkeypatch.setattr(SequenceSamplingState, "graph_grammar",
                            property(lambda self: None if self.grammar is None else False))
        eager_run = [tokens(ev) for ev in run_requests(rt, batch)]
        assert eager_rows  # the torch Sampler masked them this time
    finally:
        rt.stop()
    assert graph[2] == eager_run[2]
    assert graph[:2] == eager_run[:2]  # greedy: the argmax of the same masked logits
    for i, schema in ((0, enum), (1, records), (3, enum), (4, records)):
        body = [t for t in graph[i] if t not in eos]
        matcher = compiler.json_schema(schema).matcher()
        assert all(matcher.consume(t) for t in body), i  # every token inside the grammar
        if reasons[i] != "stop":  # a document max_tokens cut short: its prefix is all it has
            continue
        text = tok.decode(body)
        value = json.loads(text)
        if schema is enum:
            assert value in enum["enum"], text
        else:
            assert 2 <= len(value) <= 3 and all(set(r) == {"name", "age"} for r in value), text
    assert reasons[0] == reasons[3] == "stop"
