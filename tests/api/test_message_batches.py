"""Anthropic's Message Batches API through the anthropic SDK (flared.server.message_batches).

The tool model's greedy output is known (tests/api/conftest.py): with thinking off it answers "It is sunny in
Paris."; an assistant turn ending in " la" is continued with " la" until max_tokens."""

from __future__ import annotations

import time

import anthropic
import pytest

ANSWER = "It is sunny in Paris."
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(daemon):
    return anthropic.Anthropic(base_url=daemon.base, api_key="unused", max_retries=0)


def _params(**extra) -> dict:
    return {"model": "tiny", "max_tokens": 16, "messages": ASK, "thinking": {"type": "disabled"}, "temperature": 0,
            **extra}


def _wait(client, batch_id: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        b = client.messages.batches.retrieve(batch_id)
        if b.processing_status == "ended":
            return b
        assert time.monotonic() < deadline, b.processing_status
        time.sleep(0.05)


def test_a_message_batch_runs_each_request(client):
    batch = client.messages.batches.create(requests=[
        {"custom_id": "weather", "params": _params()},
        {"custom_id": "short", "params": _params(max_tokens=1)},
        {"custom_id": "bad-model", "params": _params(model="nope")},
        {"custom_id": "streamed", "params": _params(stream=True)},
    ])
    assert batch.type == "message_batch" and batch.id.startswith("msgbatch_") and batch.results_url is None
    assert batch.processing_status == "in_progress" and batch.request_counts.processing + \
        batch.request_counts.succeeded + batch.request_counts.errored == 4
    done = _wait(client, batch.id)
    assert done.ended_at is not None and done.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")
    counts = done.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled) == (0, 2, 2, 0)
    results = list(client.messages.batches.results(batch.id))
    assert [r.custom_id for r in results] == ["weather", "short", "bad-model", "streamed"]
    weather, short, bad, streamed = (r.result for r in results)
    assert weather.type == "succeeded" and weather.message.content[0].text == ANSWER
    assert weather.message.stop_reason == "end_turn"
    assert short.type == "succeeded" and short.message.stop_reason == "max_tokens"
    assert bad.type == "errored" and bad.error.error.type in ("invalid_request_error", "not_found_error")
    assert streamed.type == "errored" and "stream" in streamed.error.error.message
    assert batch.id in [b.id for b in client.messages.batches.list()]
    assert client.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)


def test_cancelling_ends_the_requests_not_yet_run(client):
    sing = {"model": "tiny", "max_tokens": 600, "temperature": 0, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": "Sing"}, {"role": "assistant", "content": "la la"}]}
    batch = client.messages.batches.create(requests=[{"custom_id": f"s{i}", "params": sing} for i in range(48)])
    with pytest.raises(anthropic.BadRequestError, match="cancel it first"):
        client.messages.batches.delete(batch.id)
    cancelling = client.messages.batches.cancel(batch.id)
    assert cancelling.processing_status in ("canceling", "ended") and cancelling.cancel_initiated_at is not None
    done = _wait(client, batch.id)
    counts = done.request_counts
    assert counts.canceled > 0 and counts.succeeded + counts.canceled + counts.errored == 48
    results = list(client.messages.batches.results(batch.id))
    assert sum(r.result.type == "canceled" for r in results) == counts.canceled
    for r in results:
        if r.result.type == "succeeded":
            assert r.result.message.content[0].text == " la" * 600


def test_a_bad_request_list_is_refused_at_once(client):
    with pytest.raises(anthropic.BadRequestError, match="custom_id"):
        client.messages.batches.create(requests=[{"custom_id": "a", "params": _params()},
                                                 {"custom_id": "a", "params": _params()}])
    with pytest.raises(anthropic.BadRequestError, match="custom_id"):
        client.messages.batches.create(requests=[{"custom_id": "has space", "params": _params()}])
    with pytest.raises(anthropic.BadRequestError, match="requests"):
        client.messages.batches.create(requests=[])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve("msgbatch_nope")
