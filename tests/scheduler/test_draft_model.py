"""Speculative decoding with a draft model (flared.execution.drafter.DraftModel, SchedulerConfig.drafter, the daemon's
--speculative-model).

The draft model continues each request greedily on its own paged KV cache, feeding only what it has not seen of
the sequence (a rejection's tail fed again over the old slots), its catch-up bounded a proposal, its pages taken
back from the requests drafted for least recently. The served model verifies the drafts as it verifies prompt
lookup's, so the tokens are plain decoding's whatever the draft model; a draft model equal to the served one has
every greedy draft kept.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch


def _model(core_path, dtype=torch.float32):
    from flared.core.load import open_core
    from flared.model.decoder import DecoderModel

    core = open_core(core_path)
    return DecoderModel(core.config, core.load_tensors(), dtype=dtype, max_positions=256)


def _greedy(model, seq, k: int) -> list[int]:
    """The model's own greedy continuation of ``seq``, each token from a whole prefill of what precedes it."""
    from flared.model.batch import ForwardBatch, SequenceChunk

    kv = model.make_kv_cache(num_pages=20, page_tokens=16)
    seq, out = list(seq), []
    for _ in range(k):
        batch = ForwardBatch.build([SequenceChunk(seq, 0, list(range(1, 20)))], page_tokens=16, device=model.device)
        out.append(int(model.forward(batch, kv)[0].argmax()))
        seq.append(out[-1])
    return out


@pytest.fixture(scope="module")
def tiny_model(tiny_core):
    return _model(tiny_core)


def test_drafts_are_the_draft_models_greedy_continuation_and_only_new_tokens_are_fed(tiny_model):
    from flared.execution.drafter import DraftModel

    vocab = tiny_model.config.vocab_size
    d = DraftModel(tiny_model, num_pages=40, page_tokens=16, max_context=256, vocab_limit=vocab)
    rng = np.random.default_rng(0)
    a, b = rng.integers(3, vocab, 37).tolist(), rng.integers(3, vocab, 20).tolist()
    drafts, depth = d.propose([11, 12], [a, b], [4, 2])
    assert drafts == [tuple(_greedy(tiny_model, a, 4)), tuple(_greedy(tiny_model, b, 2))]
    assert depth == 4 and d.counters["forwards"] == 4
    assert d.counters["caught_up"] == 36 + 19  # every token but the fed ones', whose logits give the first drafts
    # a keeps two drafts and the step's own token differs from the third: the draft model, fed the first three
    # drafts, keeps two and is fed that token alone (its logits give the first draft)
    a2 = a + list(drafts[0][:2]) + [(drafts[0][2] + 1) % vocab]
    caught = d.counters["caught_up"]
    again, depth = d.propose([11], [a2], [3])
    assert again == [tuple(_greedy(tiny_model, a2, 3))] and depth == 3
    assert d.counters["caught_up"] == caught and d._drafts[11].fed.tolist() == a2 + list(again[0][:2])
    # b moved on by its two drafts (the first fed already) and a token after them: the second and that one are fed
    b2 = b + list(drafts[1]) + [5]
    again, _ = d.propose([12], [b2], [1])
    assert again == [tuple(_greedy(tiny_model, b2, 1))] and d.counters["caught_up"] == caught + 1
    # a cap of 0 or a full context: no draft, no forward
    forwards = d.counters["forwards"]
    assert d.propose([13, 14], [a, rng.integers(3, vocab, 256).tolist()], [0, 4]) == ([(), ()], 0)
    assert d.counters["forwards"] == forwards


def test_the_pool_goes_back_from_the_least_recent_requests_and_release(tiny_model):
    from flared.execution.drafter import DraftModel

    vocab = tiny_model.config.vocab_size
    d = DraftModel(tiny_model, num_pages=9, page_tokens=16, max_context=256, vocab_limit=vocab)  # 8 usable pages
    rng = np.random.default_rng(1)
    seqs = [rng.integers(3, vocab, 40).tolist() for _ in range(4)]  # 3 pages each with their drafts
    assert d.propose([1, 2], seqs[:2], [4, 4])[0] == [tuple(_greedy(tiny_model, s, 4)) for s in seqs[:2]]
    assert len(d._free) == 2
    # a third request takes the least recently drafted one's pages; the two asking now keep theirs
    got, _ = d.propose([2, 3], [seqs[1], seqs[2]], [4, 4])
    assert got == [tuple(_greedy(tiny_model, s, 4)) for s in seqs[1:3]]
    assert d.counters["evicted"] == 1 and 1 not in d._drafts
    # no room for a fourth beside the two asking with it: it drafts nothing, they still do
    got, _ = d.propose([2, 3, 4], [seqs[1], seqs[2], seqs[3]], [4, 4, 4])
    assert got[2] == () and got[:2] == [tuple(_greedy(tiny_model, s, 4)) for s in seqs[1:3]]
    d.release(2)
    d.release(2)  # (twice: nothing more)
    assert d.propose([4], [seqs[3]], [4])[0] == [tuple(_greedy(tiny_model, seqs[3], 4))]
    assert sorted(d._free + [p for x in d._drafts.values() for p in x.pages]) == list(range(1, 9))


def test_a_long_catch_up_goes_in_over_several_proposals(tiny_model):
    from flared.execution.drafter import DraftModel

    vocab = tiny_model.config.vocab_size
    d = DraftModel(tiny_model, num_pages=40, page_tokens=16, max_context=256, vocab_limit=vocab, catch_up_tokens=50)
    seq = np.random.default_rng(2).integers(3, vocab, 120).tolist()
    assert d.propose([5], [seq], [3]) == ([()], 0)
    assert d.propose([5], [seq], [3]) == ([()], 0)
    assert d.counters["caught_up"] == 100
    drafts, depth = d.propose([5], [seq], [3])
    assert drafts == [tuple(_greedy(tiny_model, seq, 3))] and depth == 3


def test_p_min_stops_at_an_unlikely_draft_and_the_vocabulary_limit_holds(tiny_model):
    from flared.execution.drafter import DraftModel

    vocab = tiny_model.config.vocab_size
    seq = np.random.default_rng(3).integers(3, vocab, 30).tolist()
    sure = DraftModel(tiny_model, num_pages=20, page_tokens=16, max_context=256, vocab_limit=vocab, p_min=0.999)
    assert sure.propose([1], [seq], [4]) == ([()], 0)  # a random model is never that sure
    want = _greedy(tiny_model, seq, 1)[0]
    # a served vocabulary that ends before the draft model's argmax: the draft is the best token inside it
    cut = DraftModel(tiny_model, num_pages=20, page_tokens=16, max_context=256, vocab_limit=want)
    (got,), _ = cut.propose([1], [seq], [1])
    assert got[0] < want
    with pytest.raises(ValueError, match="2 pages"):
        DraftModel(tiny_model, num_pages=1, page_tokens=16, max_context=256, vocab_limit=vocab)


def _drafting_scheduler(model, spec: int):
    """A RequestScheduler whose drafts come from a DraftModel of ``model`` (not warmed up); (scheduler, drafter)."""
    import hashlib

    from flared.execution.drafter import DraftModel
    from flared.scheduler import PolicyConfig, RequestScheduler, SchedulerConfig

    drafter = DraftModel(model, num_pages=40, page_tokens=16, max_context=256, vocab_limit=model.config.vocab_size)
    return RequestScheduler(SchedulerConfig(model_identity=hashlib.sha256(b"draft").digest(), max_live_requests=4,
                                            num_pages=64, num_snapshots=16, page_tokens=16, context_capacity=256,
                                            prefill_chunk_size=64, speculative_tokens=spec, drafter=drafter),
                            PolicyConfig()), drafter


def _step(s, now: int, token: int, cost=lambda fed: 1000, keep_drafts: bool = False, accepted=()):
    """Plan, commit and complete one step of the scheduler's one request, its own token ``token``, taking
    ``cost(tokens fed)`` ns; a speculative step keeps every draft (``keep_drafts``) or those ``accepted``. Returns
    the plan."""
    from flared.scheduler import CompletionRecords, GraphKind

    plan = s.plan(now)
    fence = s.last_committed_fence + 1
    s.commit(plan, fence)
    starts = np.asarray(plan.token_starts, dtype=np.int64)
    if plan.kind == GraphKind.SPECULATIVE:
        kept = tuple(int(t) for t in plan.tokens(0)[1:]) if keep_drafts else tuple(accepted)
        records = CompletionRecords(np.asarray(plan.handles, dtype=np.int64), starts + 1 + len(kept),
                                    np.asarray(plan.generated_ends, dtype=np.int64) + len(kept),
                                    np.asarray([token], dtype=np.int64), accepted_drafts=[kept])
    else:
        records = CompletionRecords(np.asarray(plan.handles, dtype=np.int64),
                                    starts + np.asarray(plan.num_tokens, dtype=np.int64),
                                    np.asarray(plan.generated_ends, dtype=np.int64),
                                    np.asarray([token if x else -1 for x in plan.sample], dtype=np.int64))
    s.complete(fence, records, cost(int(sum(plan.num_tokens))), now)
    return plan


@pytest.mark.parametrize("base_ns, drafts_priced", [(10**10, False), (10**5, True)])
def test_a_draft_models_forwards_are_priced_before_it_drafts(tiny_model, base_ns, drafts_priced):
    """The scheduler prices a draft model's drafts before asking for them, adding its forwards' measured cost
    (DraftModel.forward_cost) to what a fed token costs: with steps of 10 s the draft model's millisecond forwards are
    nothing and every draft stays; with steps of 0.1 ms (a token fed 1% of that) they cost more than the drafts
    save, so the draft model is not asked (no forward) and the step decodes plainly, counting the drafts left
    out. Prompt lookup under the same step costs keeps its drafts (test_speculative.py)."""
    from flared.scheduler import GraphKind

    s, drafter = _drafting_scheduler(tiny_model, 4)
    s.admit(list(range(10, 40)), 200, 1, speculate=True)
    kinds, forwards = [], []
    for step in range(12):  # (each step's own token new: no n-gram recurs, so no lookup copies drafts)
        plan = _step(s, 2 + step, 100 + step, lambda fed: base_ns + base_ns // 100 * fed, keep_drafts=True)
        kinds.append(plan.kind)
        forwards.append(drafter.counters["forwards"])
    assert s.row_cost.fit() is not None and drafter.forward_cost()[0] > 0
    assert GraphKind.SPECULATIVE in kinds[:5]  # 1, 2, 4 drafts: no fit before the tokens fed varied
    if drafts_priced:
        assert kinds[-3:] == [GraphKind.DECODE] * 3 and s.counters["speculative_priced_out"] > 0
        assert forwards[-1] == forwards[-3]  # the draft model was not asked
    else:
        assert kinds[-5:] == [GraphKind.SPECULATIVE] * 5 and s.counters["speculative_priced_out"] == 0


def test_copies_come_first_while_their_record_holds(tiny_model):
    """Beside a draft model, a request whose latest prompt_lookup_max tokens occurred before takes what followed
    them there (no draft forward: a copy), while its copies' record is as good as the draft model's; a rejected
    copy moves only the copies' record (not the draft cap), and the next recurring n-gram goes to the draft
    model instead."""
    from flared.scheduler import GraphKind

    s, drafter = _drafting_scheduler(tiny_model, 2)
    prompt = [10, 11, 12, 13, 14, 15, 10, 11, 12]
    h = s.admit(prompt, 20, 1, speculate=True)
    now = 2

    def step(token, accepted=()):
        nonlocal now
        now += 1
        return _step(s, now - 1, token, accepted=accepted)

    step(13)  # the prefill samples 13: "10 11 12 13" occurred at the start, followed by 14
    plan = step(14, accepted=())  # the copy [14] is offered and (in this record) rejected; the step's token: 14
    assert plan.kind == GraphKind.SPECULATIVE and list(plan.tokens(0)) == [13, 14] and plan.copied == [True]
    assert drafter.counters["forwards"] == 0 and plan.drafter_steps == 0
    r = s.request(h)
    assert r.copy_kept / (r.copy_kept + r.copy_rejected) < 0.5 and r.spec_kept == r.spec_rejected == 1.0
    assert r.spec_cap == 1  # (a copy's round leaves the draft cap as it was)
    # "11 12 13 14" recurs, but the copies' record is now worse than the draft model's: the draft model drafts
    plan = s.plan(now)
    assert plan.kind == GraphKind.SPECULATIVE and plan.copied == [False] and plan.drafter_steps == 1
    seq = prompt + [13, 14]
    assert list(plan.tokens(0)) == [14, *_greedy(tiny_model, seq, 1)]
    assert drafter.counters["forwards"] == 1
    assert s.counters["drafter_steps"] == 0  # (counted when the step completes)


def _export(hf_dir: Path, model, tiny_hf_llama: Path, out: Path) -> Path:
    from flared.core.export import ExportOptions, export_core

    hf_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_hf_llama / name, hf_dir / name)
    model.eval().save_pretrained(hf_dir, safe_serialization=True)
    export_core(hf_dir, out, ExportOptions(concurrency=4, context_tokens=256, prefill_chunk_tokens=128))
    return out


@pytest.fixture(scope="module")
def deep_core(tiny_hf_llama, tmp_path_factory) -> Path:
    """The tiny model with eight more layers whose output projections (o, down) are zero: the same function as the
    tiny model (each adds exactly zero to the residual stream), at several times its cost. Served, with the tiny
    model drafting, every greedy draft is kept, and the drafts are worth their cost."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((tiny_hf_llama / "config.json").read_text())
    tiny = LlamaForCausalLM.from_pretrained(tiny_hf_llama, torch_dtype=torch.float32)
    torch.manual_seed(11)
    deep = LlamaForCausalLM(LlamaConfig(**{**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 8}))
    state = deep.state_dict()
    state.update(tiny.state_dict())  # (the embedding, the first layers, the final norm and the head)
    for i in range(cfg["num_hidden_layers"], cfg["num_hidden_layers"] + 8):
        state[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
        state[f"model.layers.{i}.mlp.down_proj.weight"].zero_()
    deep.load_state_dict(state)
    root = tmp_path_factory.mktemp("deep")
    return _export(root / "hf", deep, tiny_hf_llama, root / "core")


@pytest.fixture(scope="module")
def other_core(tiny_hf_llama, tmp_path_factory) -> Path:
    """A draft core with the tiny model's tokenizer and other random weights (one layer): it agrees with the served
    model now and then."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((tiny_hf_llama / "config.json").read_text())
    torch.manual_seed(7)
    root = tmp_path_factory.mktemp("other")
    return _export(root / "hf", LlamaForCausalLM(LlamaConfig(**{**cfg, "num_hidden_layers": 1})), tiny_hf_llama,
                   root / "core")


def test_the_model_thread_drafts_with_a_draft_model_and_keeps_plain_decodings_tokens(deep_core, tiny_core,
                                                                                      other_core):
    """ModelRuntime(draft_core=...): greedy, seeded sampled and logprob requests get plain decoding's tokens and
    log-probabilities with a draft model computing the served model's function at a fraction of its cost (every
    greedy draft kept; alone, in fewer rounds) and with another model; the drafter steps count the draft model's
    forwards."""
    from flared.core.load import open_core
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import FinishEvent, GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    prompt = tuple(range(60, 100))
    requests = [GenerateRequest(prompt, (), SamplingParams(max_tokens=30, temperature=0.0), frozenset({2})),
                GenerateRequest(prompt[4:], (), SamplingParams(max_tokens=30, temperature=0.0, logprobs=2),
                                frozenset({2})),
                GenerateRequest(prompt[9:], (), SamplingParams(max_tokens=30, temperature=0.8, seed=5),
                                frozenset({2}))]

    def serve(speculative, draft=None, together=True):
        rt = ModelRuntime(open_core(deep_core), torch_threads=1, prefix_cache=False, speculative=speculative,
                          draft_core=None if draft is None else open_core(draft))
        rt.start(max_pending=8)
        try:
            events = run_requests(rt, requests) if together else [run_requests(rt, [r])[0] for r in requests]
            return events, dict(rt.scheduler.counters), rt.drafter
        finally:
            rt.stop()

    def tokens(events):
        return [[t for e in ev if isinstance(e, TokenEvent) for t in e.token_ids] for ev in events]

    plain, _, _ = serve((0, 4, 2))
    _, alone, _ = serve((0, 4, 2), together=False)
    # (prompt_lookup_max 64: no copies beside the draft model, whose drafts these runs count; copies:
    # test_copies_come_first_while_their_record_holds)
    for draft, together in ((tiny_core, True), (other_core, True), (tiny_core, False)):
        fast, counters, drafter = serve((4, 64, 2), draft, together)
        assert tokens(fast) == tokens(plain)
        assert all(isinstance(ev[-1], FinishEvent) for ev in fast)
        got = [lp for e in fast[1] if isinstance(e, TokenEvent) for lp in e.logprobs]
        want = [lp for e in plain[1] if isinstance(e, TokenEvent) for lp in e.logprobs]
        assert [g.token_id for g in got] == [w.token_id for w in want]
        assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-5)
        assert counters["drafter_steps"] <= drafter.counters["forwards"]
        assert counters["speculative_accepted"] <= counters["speculative_drafted"]
        first = [ev[-1] for ev in fast][:2]
        if draft == tiny_core:  # the same function: every greedy draft kept
            assert all(f.num_accepted_drafts == f.num_drafted for f in first)
        if not together:
            # Alone, each step's draft forwards (2 layers) cost a fifth of the served step's (10): drafts pay, and
            # the greedy requests take under 0.7 times plain decoding's rounds. (Together, how many drafts the
            # pricing keeps follows the measured times: from none to most.)
            assert all(f.num_drafted > 0 for f in first) and counters["drafter_steps"] > 0
            assert counters["generation_rounds"] < 0.7 * alone["generation_rounds"]
    assert not drafter._drafts  # every retired request's pages went back


def test_a_small_draft_pool_evicts_and_keeps_the_tokens(deep_core, tiny_core):
    """ModelRuntime(draft_kv_tokens=64) (--ctx-size-draft): the draft's pool holds 64 tokens, one request's context
    at a time (each grows to 60) where three run together; the tokens are still plain decoding's, and the pool
    ends whole."""
    from flared.core.load import open_core
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    requests = [GenerateRequest(tuple(range(60 + i, 90 + i)), (), SamplingParams(max_tokens=30, temperature=0.0),
                                frozenset()) for i in range(3)]

    def serve(**kw):
        rt = ModelRuntime(open_core(deep_core), torch_threads=1, prefix_cache=False, **kw)
        rt.start(max_pending=8)
        try:
            events = run_requests(rt, requests)
            return [[t for e in ev if isinstance(e, TokenEvent) for t in e.token_ids] for ev in events], rt.drafter
        finally:
            rt.stop()

    page = open_core(deep_core).manifest.capacities.page_tokens
    plain, _ = serve(speculative=(0, 4, 2))
    small, drafter = serve(speculative=(4, 64, 2), draft_core=open_core(tiny_core), draft_kv_tokens=64)
    assert small == plain
    assert drafter.num_pages == -(-64 // page) + 1  # (page 0 stays out)
    # every page back in the pool, once each, none of them page 0, whatever the requests took and gave back
    assert not drafter._drafts and sorted(drafter._free) == list(range(1, drafter.num_pages))


def test_a_draft_model_must_share_the_vocabulary(tiny_core, tmp_path):
    from flared.config import ConfigError
    from flared.core.load import open_core
    from flared.runtime.session import _check_draft_vocabulary

    core = open_core(tiny_core)
    _check_draft_vocabulary(core, core)
    swapped = tmp_path / "swapped"
    shutil.copytree(tiny_core, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    (a, i), (b, j) = sorted(vocab.items(), key=lambda kv: kv[1])[40:42]
    vocab[a], vocab[b] = j, i
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match=f"token {i} is"):
        _check_draft_vocabulary(core, open_core(swapped, verify_hashes=False))


def test_a_draft_model_of_another_vocabulary_is_refused_at_load(tiny_core, tiny_hf_llama, tmp_path):
    """LoadedSession.load checks the draft core's vocabulary before any weight is read: one 200 ids wider than the
    served model's is a ConfigError naming both sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flared.config import ConfigError, ServerConfig
    from flared.core.export import ExportOptions, export_core
    from flared.runtime.session import LoadedSession

    config = ServerConfig(port=0, admin_socket=None, speculative_model=str(tiny_core))
    assert config.speculative_tokens == 4  # a draft model's default
    assert LoadedSession.load(tiny_core, config).runtime.draft_core is not None
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_hf_llama / name, hf / name)
    cfg = json.loads((tiny_hf_llama / "config.json").read_text())
    LlamaForCausalLM(LlamaConfig(**{**cfg, "vocab_size": cfg["vocab_size"] + 200, "num_hidden_layers": 1})).save_pretrained(
        hf, safe_serialization=True)
    export_core(hf, tmp_path / "wide", ExportOptions(concurrency=4, context_tokens=256, prefill_chunk_tokens=128))
    wide = ServerConfig(port=0, admin_socket=None, speculative_model=str(tmp_path / "wide"))
    with pytest.raises(ConfigError, match=f"{cfg['vocab_size'] + 200} token ids and the served model {cfg['vocab_size']}"):
        LoadedSession.load(tiny_core, wide)


def test_server_config_and_flags_for_a_draft_model():
    from click.testing import CliRunner

    from flared.cli.daemon import main
    from flared.config import ConfigError, ServerConfig

    assert ServerConfig(speculative_model="m", speculative_tokens=2).speculative_tokens == 2
    assert ServerConfig(speculative_model="m").draft_p_min == 0.0
    for bad in (-0.1, 1.5, "x", True):
        with pytest.raises(ConfigError, match="draft_p_min"):
            ServerConfig(speculative_model="m", draft_p_min=bad)
    with pytest.raises(ConfigError, match="speculative_model"):
        ServerConfig(speculative_model="")
    out = CliRunner().invoke(main, ["run", "--model-draft", "m", "--draft-p-min", "2", "--no-admin-socket"])
    assert out.exit_code == 2 and "draft_p_min" in out.output
    assert ServerConfig(speculative_model="m", draft_kv_tokens=4096).draft_kv_tokens == 4096
    for bad in (255, 1.5, "x"):
        with pytest.raises(ConfigError, match="draft_kv_tokens"):
            ServerConfig(speculative_model="m", draft_kv_tokens=bad)
    out = CliRunner().invoke(main, ["run", "-md", "m", "-cd", "100", "--no-admin-socket"])
    assert out.exit_code == 2 and "draft_kv_tokens" in out.output


def test_the_daemon_serves_with_a_draft_model(deep_core, tiny_core, tmp_path):
    """`flared run DEEP --speculative-model TINY` (a draft computing the served model's function, cheaper): the
    openai SDK's greedy chat gets the one-shot runner's text, and /metrics counts the drafts kept and the
    drafter's steps."""
    openai = pytest.importorskip("openai")
    from flared.runtime.oneshot import OneShot
    from flared_testing.daemon import Daemon

    messages = [{"role": "user", "content": "Hello, world! How are you today?"}]
    d = Daemon(deep_core, tmp_path, "--speculative-model", str(tiny_core), "--draft-max", "3",
               "--prompt-lookup-max", "64")  # (no copies beside the draft: its drafts are what this counts)
    try:
        client = openai.OpenAI(base_url=d.base + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
        want = OneShot.open(deep_core).generate(messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == want["text"]
        status, text = d.request("GET", "/metrics")
        assert status == 200
        from prometheus_client.parser import text_string_to_metric_families

        series = {s.name: s.value for family in text_string_to_metric_families(text.decode())
                  for s in family.samples}
        assert series["flare_speculative_drafter_steps_total"] > 0
        assert series["flare_speculative_accepted_tokens_total"] > 0
        assert "speculative decoding with the draft model" in d.log()
    finally:
        assert d.stop() == 0, d.log()
