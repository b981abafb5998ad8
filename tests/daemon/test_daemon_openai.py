"""The real daemon driven by the openai SDK (sync and async) on a tiny random-weight Llama core.

Outputs of a random model are gibberish but deterministic, which is all these
tests need: greedy results are compared with flared's one-shot runner (a
different code path: no scheduler, no HTTP) and with each other.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

MODEL = "tiny"
MSGS = [{"role": "user", "content": "Hello, world! How are you today?"}]


@pytest.fixture(scope="module")
def daemon(tiny_core: Path, tmp_path_factory, daemon_cls):
    d = daemon_cls(tiny_core, tmp_path_factory.mktemp("daemon"))
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oneshot(tiny_core):
    from flared.runtime.oneshot import OneShot

    return OneShot.open(tiny_core)


def test_models_list_and_card(client, daemon):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert len(ids) == 1
    card = client.models.retrieve(MODEL)
    assert card.id == ids[0]
    status, body = daemon.request("GET", "/v1/models/" + body_root(daemon))
    assert status == 200 and body["id"] == ids[0] and body["max_model_len"] == 256
    status, body = daemon.request("GET", "/v1/models/no/such/model")
    assert status == 404 and "does not exist" in body["error"]["message"]


def body_root(daemon) -> str:
    return daemon.request("GET", "/v1/models")[1]["data"][0]["root"]


def test_chat_greedy_matches_the_oneshot_runner(client, oneshot):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, temperature=0)
    ref = oneshot.generate(messages=MSGS, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == ref["text"]
    assert r.choices[0].finish_reason == ref["finish_reason"]
    assert r.usage.completion_tokens == len(ref["token_ids"])
    assert r.usage.prompt_tokens == len(ref["prompt_token_ids"])
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_stream_equals_non_stream_and_reports_usage_last(client):
    full = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_seeded_sampling_is_reproducible_and_n_gives_choices(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=1.0, seed=1234, n=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert len({c.text for c in a.choices}) > 1  # per-choice seeds differ
    assert 0 < a.usage.completion_tokens <= 36


def _counter(daemon, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = daemon.request("GET", "/metrics")
    assert status == 200
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


def test_n_choices_share_the_prompt_prefill(client, daemon):
    """n > 1 on a long prompt: the first choice prefills it, the others reuse it from the prefix cache (the
    prompt's tokens are computed about once, not n times), and each choice is still exactly what a single
    request with its seed gives."""
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 10)  # not seen before by this daemon
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0)
    computed, hits = _counter(daemon, "flare_prompt_tokens_total"), _counter(daemon, "flare_prefix_hits_total")
    both = client.completions.create(**kw, seed=100, n=4)
    computed = _counter(daemon, "flare_prompt_tokens_total") - computed
    num_prompt = both.usage.prompt_tokens
    assert 100 <= num_prompt <= 240
    assert _counter(daemon, "flare_prefix_hits_total") - hits == 3
    assert computed < 2 * num_prompt, computed  # four choices: ~one prefill of the prompt, not four
    singles = [client.completions.create(**kw, seed=100 + i).choices[0].text for i in range(4)]
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == singles


def test_a_predicted_output_changes_no_token_and_reports_its_drafts(client):
    """OpenAI's ``prediction`` (text or text parts) is accepted; the answer is the one without it, and usage
    reports the prediction's accepted and rejected tokens (none here: this daemon does not speculate)."""
    plain = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0)
    text = plain.choices[0].message.content
    for content in (text, [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0,
                                           prediction={"type": "content", "content": content})
        assert r.choices[0].message.content == text
        details = r.usage.completion_tokens_details
        assert details.accepted_prediction_tokens == 0 and details.rejected_prediction_tokens == 0
    assert plain.usage.completion_tokens_details is None


def test_stop_string_cuts_the_text_and_finishes_with_stop(client):
    full = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=24, temperature=0).choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_are_consistent(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) >= 1
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.logprob <= 0


def test_async_concurrent_streams_equal_their_sequential_results(client, daemon):
    prompts = ["The quick brown fox", "Hello, world!", "def add(a, b):", "Paris is the capital"]
    sequential = [client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0).choices[0].text
                  for p in prompts]

    async def one(ac, p):
        stream = await ac.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main():
        ac = openai.AsyncOpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)
        try:
            return await asyncio.gather(*(one(ac, p) for p in prompts * 2))
        finally:
            await ac.close()

    assert asyncio.run(main()) == sequential * 2


@pytest.mark.parametrize("raw, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"\xff\xfe{}", 400, "not valid UTF-8"),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "'messages'"),
    (json.dumps({"model": MODEL, "messages": MSGS, "temperature": "warm"}).encode(), 400, "'temperature'"),
    (json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 10_000}).encode(), 400,
     "maximum context length is 256 tokens"),
    (json.dumps({"model": "other", "messages": MSGS}).encode(), 404, "does not exist"),
    (json.dumps({"model": MODEL, "messages": MSGS, "prediction": {"type": "text", "content": "x"}}).encode(), 400,
     "'prediction'"),
    (json.dumps({"model": MODEL, "messages": MSGS, "prediction": {"type": "content", "content": 5}}).encode(), 400,
     "'prediction.content'"),
])
def test_bad_requests_get_json_errors_and_the_daemon_keeps_serving(daemon, raw, status, needle):
    got, body = daemon.request("POST", "/v1/chat/completions", raw=raw)
    assert got == status and needle in body["error"]["message"], body
    assert daemon.request("GET", "/health")[0] == 200


def test_context_overflow_names_both_counts_and_the_hint(daemon):
    status, body = daemon.request("POST", "/v1/completions",
                                  {"model": MODEL, "prompt": "Hello " * 50, "max_tokens": 250})
    msg = body["error"]["message"]
    assert status == 400 and "250 for the completion" in msg and "in the prompt" in msg and "--context" in msg


def test_health_and_unknown_route(daemon):
    assert daemon.request("GET", "/health") == (200, {"status": "ok"})
    status, body = daemon.request("GET", "/v2/nothing")
    assert status == 404 and body["error"]["type"] == "not_found_error"
