"""Constrained decoding and scoring in the model thread (tiny core, no HTTP).

A real ModelRuntime over the tiny random-weight core: grammar masks touch only
constrained rows, a grammar that fails mid-generation ends that request alone,
and a whole-prompt scoring request runs as the scheduler's SCORED_PREFILL with
the same numbers as transformers.
"""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from flared.core.load import open_core
from flared.model.grammar import GrammarCompiler, GrammarError, check_schema
from flared.model.sampling import SamplingParams
from flared.runtime.request import ErrorEvent, FinishEvent, GenerateRequest, ScoredEvent, TokenEvent
from flared.runtime.worker import ModelRuntime
from flared_testing.runtime import run_requests

ENUM = {"enum": ["fox", "dog", "Paris", "hello world"]}


@pytest.fixture(scope="module")
def runtime(tiny_core):
    rt = ModelRuntime(open_core(tiny_core), torch_threads=1)
    rt.start(max_pending=16)
    yield rt
    rt.stop()


@pytest.fixture(scope="module")
def compiler(tiny_core, runtime):
    core = runtime.core
    return GrammarCompiler((tiny_core / core.manifest.tokenizer).read_text(),
                           vocab_size=core.config.vocab_size, eos_token_ids=core.manifest.tokens.eos_token_ids)


def _run(runtime, requests):
    return run_requests(runtime, requests)


def _tokens(events):
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]


def _request(prompt, grammar=None, max_tokens=24, **kw):
    eos = frozenset({2})
    return GenerateRequest(tuple(prompt), (), SamplingParams(max_tokens=max_tokens, **kw), eos, grammar=grammar)


def test_objects_keep_the_schema_s_property_order(compiler, tiny_core):
    """A schema's properties are written in the order it declares them (OpenAI's structured outputs promise it;
    a forced tool call names its function before its arguments), not sorted; the same properties in another order
    are another grammar."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_core / "tokenizer.json"))
    props = {"name": {"type": "string"}, "age": {"type": "integer"}}

    def accepts(schema, text):
        matcher = compiler.json_schema(schema).matcher()
        return all(matcher.consume(t) for t in tok.encode(text, add_special_tokens=False).ids) and matcher.accepting

    declared = {"type": "object", "properties": props, "required": ["name", "age"], "additionalProperties": False}
    reverse = dict(declared, properties=dict(reversed(list(props.items()))))
    assert accepts(declared, '{"name":"x","age":1}')
    assert not accepts(declared, '{"age":1,"name":"x"}')
    assert accepts(reverse, '{"age":1,"name":"x"}')
    assert not accepts(reverse, '{"name":"x","age":1}')


def test_objects_that_list_properties_allow_no_others_unless_they_say_so(compiler, tiny_core):
    """As vLLM's default backend and llama.cpp read schemas: an object listing properties and silent on others
    takes no others (nested ones too, and a property named "properties"); additionalProperties true keeps them
    open; allOf members are merged, not closed one against another; const values are left alone."""
    from tokenizers import Tokenizer

    from flared.model.grammar import closed_objects

    tok = Tokenizer.from_file(str(tiny_core / "tokenizer.json"))

    def accepts(schema, text):
        matcher = compiler.json_schema(schema).matcher()
        return all(matcher.consume(t) for t in tok.encode(text, add_special_tokens=False).ids) and matcher.accepting

    person = {"type": "object", "properties": {"name": {"type": "string"}, "pet": {
        "type": "object", "properties": {"kind": {"type": "string"}}}}, "required": ["name"]}
    assert accepts(person, '{"name":"x","pet":{"kind":"cat"}}')
    assert not accepts(person, '{"name":"x","age":3}')
    assert not accepts(person, '{"name":"x","pet":{"kind":"cat","age":3}}')
    assert accepts(dict(person, additionalProperties=True), '{"name":"x","age":3}')
    assert accepts({"type": "object", "properties": {"properties": {"type": "integer"}}}, '{"properties":1}')
    merged = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}], "required": ["a", "b"]}
    assert accepts(merged, '{"a":1,"b":2}')
    assert closed_objects({"const": {"properties": {}}}) == {"const": {"properties": {}}}
    assert closed_objects({"type": "object"}) == {"type": "object"}  # json_object: any object
    assert closed_objects(person)["additionalProperties"] is False and "additionalProperties" not in person


def test_masks_touch_only_constrained_rows(runtime, compiler, tiny_core):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_core / "tokenizer.json"))
    prompt = tok.encode("<|im_start|>user\nPick one.<|im_end|>\n<|im_start|>assistant\n").ids
    grammar = compiler.json_schema(ENUM)
    alone = _tokens(_run(runtime, [_request(prompt, temperature=0.0)])[0])
    mixed = _run(runtime, [_request(prompt, temperature=0.0), _request(prompt, grammar, temperature=0.0),
                           _request(prompt, grammar, temperature=1.0, seed=7)])
    assert _tokens(mixed[0]) == alone  # the unconstrained row is untouched by its neighbours' masks
    for events in mixed[1:]:
        assert isinstance(events[-1], FinishEvent) and events[-1].reason == "stop"
        assert json.loads(tok.decode(_tokens(events)[:-1])) in ENUM["enum"]  # last token: EOS


def test_min_tokens_yields_to_a_complete_grammar(runtime, compiler, tiny_core):
    """min_tokens bans EOS, but a grammar whose output is complete allows only EOS: the grammar wins and the
    output ends there, valid, rather than failing or drawing a token neither allows."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_core / "tokenizer.json"))
    prompt = tok.encode("<|im_start|>user\nPick one.<|im_end|>\n<|im_start|>assistant\n").ids
    grammar = compiler.json_schema(ENUM)
    for temperature in (0.0, 1.0):
        (events,) = _run(runtime, [_request(prompt, grammar, temperature=temperature, seed=5, min_tokens=20,
                                            min_tokens_banned=frozenset({2}))])
        assert isinstance(events[-1], FinishEvent) and events[-1].reason == "stop"
        tokens = _tokens(events)
        assert tokens[-1] == 2 and len(tokens) < 20
        assert json.loads(tok.decode(tokens[:-1])) in ENUM["enum"]


def test_grammar_failure_mid_generation_ends_that_request(runtime, tiny_core):
    core = runtime.core
    # A lexer-state budget the schema outgrows a few tokens in: the matcher fails during generation,
    # not at compile time.
    tight = GrammarCompiler((tiny_core / core.manifest.tokenizer).read_text(), vocab_size=core.config.vocab_size,
                            eos_token_ids=core.manifest.tokens.eos_token_ids,
                            limits=llguidance.LLParserLimits(max_lexer_states=40))
    grammar = tight.json_schema({"type": "object", "properties": {"a": {"type": "string", "minLength": 30}},
                                 "required": ["a"]})
    prompt = [5, 6, 7, 8]
    failed, other = _run(runtime, [_request(prompt, grammar, max_tokens=40, temperature=0.0),
                                   _request(prompt, max_tokens=12, temperature=0.0, logit_bias={2: -100.0})])
    assert isinstance(failed[-1], ErrorEvent)
    assert "constrained decoding failed" in str(failed[-1].error) and "too many states" in str(failed[-1].error)
    assert isinstance(other[-1], FinishEvent) and other[-1].reason == "length"
    assert len(_tokens(other)) == 12
    assert runtime.health() == (True, "ok")


def test_whole_prompt_scoring_matches_transformers(runtime, tiny_hf_llama):
    from transformers import LlamaForCausalLM

    prompt = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
    events = _run(runtime, [GenerateRequest(tuple(prompt), (), SamplingParams(temperature=0.0, max_tokens=1),
                                            frozenset(), score_from=1)])[0]
    assert isinstance(events[0], ScoredEvent) and isinstance(events[-1], FinishEvent)
    assert runtime.stats["launches_scored_prefill"] >= 1
    model = LlamaForCausalLM.from_pretrained(tiny_hf_llama, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    want = [lp[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    assert list(events[0].logprobs) == pytest.approx(want, abs=2e-4)


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "object", "properties": {"x": {"type": "array", "contains": {"type": "integer"}}}}, "contains"),
    ({"anyOf": [{"type": "string"}, {"dependentRequired": {}}]}, "dependentRequired"),
    ({"$defs": {"a": {"unevaluatedProperties": False}}}, "unevaluatedProperties"),
    ({"type": "string", "format": "phone"}, "format"),
    ({"type": "object", "x-custom": 1}, "x-custom"),
])
def test_check_schema_names_the_keyword(schema, keyword):
    with pytest.raises(GrammarError) as info:
        check_schema(schema)
    assert info.value.keyword == keyword and repr(keyword) in str(info.value)


def test_annotations_pass_and_grammars_compile_once(compiler):
    schema = {"title": "T", "description": "d", "type": "object", "properties": {
        "a": {"type": "integer", "default": 1, "examples": [1]}}, "required": ["a"],
              "$schema": "https://json-schema.org/draft/2020-12/schema"}
    check_schema(schema)
    first = compiler.json_schema(schema)
    assert compiler.json_schema(json.loads(json.dumps(schema))) is first  # cached by canonical text
    m1, m2 = first.matcher(), first.matcher()
    assert m1 is not m2 and not m1.failed


def test_a_matcher_s_mask_ahead_of_drafts_leaves_it_where_it_was(runtime, compiler, tiny_core):
    """GrammarMatcher.ahead: the mask after some tokens, as a matcher that consumed them gives it, with the matcher
    back where it was; past a token the grammar refuses, the mask before that token."""
    import array

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_core / "tokenizer.json"))
    grammar = compiler.json_schema({"type": "array", "items": {"const": "fox"}, "minItems": 3, "maxItems": 3})
    text = tok.encode('["fox","fox","fox"]', add_special_tokens=False).ids
    words = (runtime.core.config.vocab_size + 31) // 32

    def mask(m):
        w = array.array("I", bytes(4 * words))
        m.fill_bitmask(w.buffer_info()[0], 4 * words)
        return w.tobytes()

    m = grammar.matcher()
    start = mask(m)
    for j in range(len(text)):
        ahead = m.ahead(text[:j], words)
        assert mask(m) == start and m.num_consumed == 0
        walked = grammar.matcher()
        assert all(walked.consume(t) for t in text[:j])
        assert mask(ahead) == mask(walked)
    bad = tok.encode("[7", add_special_tokens=False).ids
    assert mask(m.ahead(bad, words)) == mask(m.ahead(bad[:1], words))


def test_constrained_requests_speculate_under_each_row_s_own_mask(compiler, tiny_core):
    """With speculative decoding on, constrained requests feed drafts: each fed row draws under the grammar's mask
    after the drafts before it, the matcher comes back, and the model thread consumes what is kept. A greedy and a
    seeded sampled request give plain decoding's tokens and valid JSON, with drafts kept."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_core / "tokenizer.json"))
    schema = {"type": "array", "items": {"const": "the quick fox"}, "minItems": 6, "maxItems": 6}
    grammar = compiler.json_schema(schema)
    prompt = tok.encode("<|im_start|>user\nList it.<|im_end|>\n<|im_start|>assistant\n").ids
    requests = [_request(prompt, grammar, max_tokens=64, temperature=0.0),
                _request(prompt, grammar, max_tokens=64, temperature=0.7, seed=3)]

    def serve(speculative):
        rt = ModelRuntime(open_core(tiny_core), torch_threads=1, prefix_cache=False, speculative=speculative)
        rt.start(max_pending=8)
        try:
            return _run(rt, requests), dict(rt.scheduler.counters)
        finally:
            rt.stop()

    plain, _ = serve((0, 4, 2))
    fast, counters = serve((4, 4, 2))
    for a, b in zip(plain, fast):
        assert _tokens(a) == _tokens(b)
        assert isinstance(b[-1], FinishEvent) and b[-1].reason == "stop"
        assert json.loads(tok.decode(_tokens(b)[:-1])) == ["the quick fox"] * 6
    assert counters["launches_speculative"] > 0 and counters["speculative_accepted"] > 0


@pytest.mark.parametrize("cpus", [2, 16])  # one after another, and on llguidance's threads
def test_fill_bitmasks_writes_each_rows_mask(compiler, monkeypatch, cpus):
    """grammar.fill_bitmasks writes each matcher's mask at its row (the same words as the matcher's own
    fill_bitmask), all ones for a failed matcher, and an AheadMask's words as they are; rows it is not given are
    left alone."""
    import array
    import os

    import numpy as np

    from flared.model.grammar import AheadMask, fill_bitmasks

    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    words = (compiler.vocab_size + 31) // 32
    grammar = compiler.json_schema(ENUM)
    ms = [grammar.matcher() for _ in range(3)]
    first = np.zeros(words, dtype=np.int32)
    ms[1].fill_bitmask(first.ctypes.data, first.nbytes)
    allowed = np.nonzero(np.unpackbits(first.view(np.uint8), bitorder="little"))[0]
    assert ms[1].consume(int(allowed[-1]))  # one matcher a token further on: its mask differs
    failed = grammar.matcher()
    failed.consume(compiler.vocab_size - 1)  # outside the enum: the matcher fails
    assert failed.failed
    ahead = AheadMask(array.array("I", range(words)))
    out = np.full((7, words), 7, dtype=np.int32)
    fill_bitmasks([(ms[0], 0), (ms[1], 2), (failed, 3), (ahead, 4), (ms[2], 6)], out.ctypes.data, 4 * words, 7)
    want = np.zeros((3, words), dtype=np.int32)
    for k, m in enumerate(ms):
        m.fill_bitmask(want[k].ctypes.data, 4 * words)
    assert (out[0] == want[0]).all() and (out[2] == want[1]).all() and (out[6] == want[2]).all()
    assert (out[3] == -1).all()
    assert (out[4].view(np.uint32) == np.arange(words)).all()
    assert (out[1] == 7).all() and (out[5] == 7).all()
    assert want[0].any()


def test_the_sampler_stages_grammar_masks_in_its_slot_tables(compiler):
    """With graph tables, a constrained request holds a slot (flagged in ``slot_grammar``) and is drawn by a
    graph's sampler; stage_grammar_masks copies its mask into its slot's row of ``grammar_masks``. A request with
    min_tokens' bans, and a Sampler without graph tables, leave the constrained row to the torch Sampler."""
    import numpy as np

    from flared.model.sampling import Sampler

    vocab = compiler.vocab_size
    sampler = Sampler(vocab, max_penalty_slots=4, graph_tables=True)
    grammar = compiler.json_schema(ENUM)
    free = sampler.add_sequence(SamplingParams(temperature=0.0, logit_bias={3: 1.0}), [1, 2])
    constrained = sampler.add_sequence(SamplingParams(temperature=0.7), [1, 2], grammar=grammar.matcher())
    banned = sampler.add_sequence(SamplingParams(temperature=0.7, min_tokens=3, min_tokens_banned=frozenset({2})),
                                  [1, 2], grammar=grammar.matcher())
    assert (free.graph_grammar, constrained.graph_grammar, banned.graph_grammar) == (None, True, False)
    assert constrained.graph_samples and constrained.graph_shaped and not banned.graph_samples
    assert sampler.slot_grammar[constrained.penalty_slot] == 1 and sampler.slot_grammar[free.penalty_slot] == 0
    sampler.stage_grammar_masks([constrained])
    want = np.zeros((vocab + 31) // 32, dtype=np.int32)
    constrained.grammar.fill_bitmask(want.ctypes.data, want.nbytes)
    assert (sampler.grammar_masks[constrained.penalty_slot].numpy() == want).all()
    plain = Sampler(vocab, max_penalty_slots=4).add_sequence(SamplingParams(temperature=0.7), [1, 2],
                                                             grammar=grammar.matcher())
    assert plain.graph_grammar is False and not plain.graph_samples
