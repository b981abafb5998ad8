"""/v1/systemone: thinking off through the template, answer only, short default max_tokens."""

from __future__ import annotations

import openai

ANSWER = "It is sunny in Paris."
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_answer_only_with_thinking_off(daemon):
    # the request asks for thinking; the route turns it off (the model answers instead of reasoning)
    status, body = daemon.request("POST", "/v1/systemone", {
        "model": "tiny", "messages": ASK, "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": True}})
    assert status == 200, body
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": ANSWER} and body["object"] == "chat.completion"
    assert body["choices"][0]["finish_reason"] == "stop"


def test_stream_and_sdk(daemon):
    client = openai.OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)
    # the SDK has no systemone method: post the chat body to the route with the SDK's low-level client
    stream = client.post("/systemone", body={"model": "tiny", "messages": ASK, "temperature": 0, "stream": True},
                         cast_to=object, stream=True, stream_cls=openai.Stream[object])
    events = list(stream)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == ANSWER and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("reasoning" not in e["choices"][0]["delta"] for e in events)


def test_default_max_tokens_and_rejections(daemon):
    # the prompt leaves ~1000 tokens of room; with EOS banned the route's default caps the answer at 256
    status, body = daemon.request("POST", "/v1/systemone", {
        "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "temperature": 0,
        "logit_bias": {"2": -100}})
    assert status == 200 and body["usage"]["completion_tokens"] == 256
    assert body["choices"][0]["finish_reason"] == "length"
    status, body = daemon.request("POST", "/v1/systemone", {
        "model": "tiny", "messages": ASK, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert status == 400 and "tools" in body["error"]["message"]
