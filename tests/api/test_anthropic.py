"""/v1/messages and /v1/messages/count_tokens through the real anthropic SDK against the daemon."""

from __future__ import annotations

import anthropic
import pytest

REASONING = "Let me check the weather."
ANSWER = "It is sunny in Paris."
TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# this SDK version no longer has a temperature argument; the API field still exists
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(daemon):
    return anthropic.Anthropic(base_url=daemon.base, api_key="unused", max_retries=0)


def test_tool_use_round_trip(client):
    m = client.messages.create(model="tiny", max_tokens=40, messages=ASK, tools=TOOLS, extra_body=GREEDY,
                               system="You are terse.")
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[0].thinking == REASONING
    use = m.content[1]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert m.usage.input_tokens > 0 and m.usage.output_tokens == 9
    # tool result back through the template, thinking off: a text answer
    m2 = client.messages.create(
        model="tiny", max_tokens=40, tools=TOOLS, extra_body=GREEDY, thinking={"type": "disabled"},
        messages=ASK + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                      "content": [{"type": "text", "text": "sunny, 21 C"}]}]}])
    assert m2.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in m2.content] == [("text", ANSWER)]
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens > m.usage.input_tokens + 10


def test_stream_event_order(client):
    with client.messages.stream(model="tiny", max_tokens=40, messages=ASK, tools=TOOLS, extra_body=GREEDY) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                  "content_block_stop", "message_delta", "message_stop")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    # blocks open, get deltas and close in order: thinking (0), then tool_use (1)
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "thinking"), (1, "tool_use")]
    stops = [i for i, e in enumerate(events) if e.type == "content_block_stop"]
    assert stops[0] < events.index(starts[1])
    json_deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta"]
    assert len(json_deltas) >= 2
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "tool_use" and delta.usage.output_tokens == 9
    assert final.content[0].thinking == REASONING and final.content[1].input == {"city": "Paris"}


def test_raw_stream_has_ping_and_event_names(daemon):
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    conn.request("POST", "/v1/messages", body=json.dumps({
        "model": "tiny", "max_tokens": 5, "stream": True, "messages": ASK, "stop_sequences": ["zzz"],
        "thinking": {"type": "disabled"}}), headers={"content-type": "application/json"})
    raw = conn.getresponse().read().decode()
    names = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names[2:-2] == ["content_block_start", "content_block_delta", "content_block_stop"]


def test_stop_sequence(client):
    m = client.messages.create(model="tiny", max_tokens=40, messages=ASK, extra_body=GREEDY,
                               thinking={"type": "disabled"}, stop_sequences=["sunny"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "sunny"
    assert m.content[0].text == "It is "


def test_count_tokens_and_errors(client):
    n = client.messages.count_tokens(model="tiny", messages=ASK)
    with_tools = client.messages.count_tokens(model="tiny", messages=ASK, tools=TOOLS)
    assert 0 < n.input_tokens < with_tools.input_tokens
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=4, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=ASK, tools=TOOLS,
                               tool_choice={"type": "tool"})  # no name (any/tool are served)
    assert "tool_choice" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="maximum context length is 1024"):
        client.messages.create(model="tiny", max_tokens=5000, messages=ASK)  # context is 1024


def test_assistant_prefill_is_continued(client):
    m = client.messages.create(model="tiny", max_tokens=3, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Sing."}, {"role": "assistant", "content": "Sing la"}])
    assert m.stop_reason == "max_tokens" and m.content[0].text == " la la la"


def test_thinking_budget_ends_the_reasoning(client):
    """thinking.budget_tokens: past the budget the reasoning's end marker is forced, so a budget of 1 leaves the
    thinking block empty (the first token opens it) and the answer follows as before."""
    kw = dict(model="tiny", max_tokens=40, messages=ASK, tools=TOOLS, extra_body=GREEDY)
    full = client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 30})
    assert [b.type for b in full.content] == ["thinking", "tool_use"] and full.content[0].thinking == REASONING
    cut = client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1})
    assert cut.content[0].type == "tool_use" or cut.content[0].thinking == ""
    assert cut.content[-1].type == "tool_use" and cut.content[-1].input == {"city": "Paris"}
    assert cut.usage.output_tokens == full.usage.output_tokens - 1  # the reasoning's one token left out
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 40})  # not under max_tokens


def test_text_documents_are_read_and_pdfs_refused(client):
    """document blocks with a text or content source become the prompt's text (title, context, text); a PDF source
    is a 400 naming it."""
    doc = {"type": "document", "title": "Weather report", "context": "From this morning.",
           "source": {"type": "text", "media_type": "text/plain", "data": "Paris: sunny, 24 degrees."}}
    question = {"type": "text", "text": "What is the weather in Paris?"}
    plain = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [question]}])
    with_doc = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [doc, question]}])
    as_text = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Weather report\n\nFrom this morning.\n\nParis: sunny, 24 degrees."}, question]}])
    assert plain.input_tokens < with_doc.input_tokens == as_text.input_tokens
    content_doc = {"type": "document", "source": {"type": "content", "content": [
        {"type": "text", "text": "Paris: sunny, "}, {"type": "text", "text": "24 degrees."}]}}
    m = client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [content_doc,
                                                                                                 question]}],
                               extra_body=GREEDY)
    assert m.type == "message" and m.usage.input_tokens > plain.input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
            question]}])
    message = e.value.body["error"]["message"]
    assert "messages[0].content[0].source" in message and "PDF" in message
    with pytest.raises(anthropic.BadRequestError, match="citations"):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            dict(doc, citations={"enabled": True}), question]}])
