"""/v1/responses through the real openai SDK (client.responses) against the daemon."""

from __future__ import annotations

import json

import openai
import pytest

REASONING = "Let me check the weather."
ANSWER = "It is sunny in Paris."
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)


def test_function_call_round_trip_with_previous_response(client):
    r = client.responses.create(model="tiny", input=QUESTION, tools=TOOLS, temperature=0, max_output_tokens=40,
                                instructions="Be brief.")
    assert r.status == "completed" and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == REASONING
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert r.usage.output_tokens == 9
    # stored: retrievable, and the next turn continues it with only the tool output as input
    assert client.responses.retrieve(r.id).output[1].call_id == call.call_id
    r2 = client.responses.create(model="tiny", previous_response_id=r.id, tools=TOOLS, temperature=0,
                                 max_output_tokens=40, reasoning={"effort": "none"},
                                 input=[{"type": "function_call_output", "call_id": call.call_id,
                                         "output": "sunny, 21 C"}])
    assert r2.output_text == ANSWER and [o.type for o in r2.output] == ["message"]
    assert r2.previous_response_id == r.id and r2.usage.input_tokens > r.usage.input_tokens + 20
    # the same conversation sent in full gives the same prompt
    r3 = client.responses.create(model="tiny", tools=TOOLS, temperature=0, max_output_tokens=40, store=False,
                                 reasoning={"effort": "none"}, input=[
                                     {"role": "user", "content": QUESTION},
                                     {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                      "arguments": call.arguments},
                                     {"type": "function_call_output", "call_id": call.call_id,
                                      "output": "sunny, 21 C"}])
    assert r3.output_text == ANSWER and r3.usage.input_tokens == r2.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r3.id)


def test_stream_events(client):
    events = list(client.responses.create(model="tiny", input=QUESTION, tools=TOOLS, temperature=0,
                                          max_output_tokens=40, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    arg_deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(arg_deltas) >= 2 and json.loads("".join(arg_deltas)) == {"city": "Paris"}
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == "".join(arg_deltas)
    final = events[-1].response
    assert final.output[1].arguments == done.arguments and final.usage.output_tokens == 9
    assert client.responses.retrieve(final.id).status == "completed"


def test_text_stream_and_incomplete(client):
    events = list(client.responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=1,
                                          reasoning={"effort": "none"}, stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[4].delta == ANSWER


def test_output_text_logprobs(client):
    """include ["message.output_text.logprobs"] with top_logprobs: each generated token's logprob and its
    alternatives, as chat completions report them for the same generation; streamed in the text deltas."""
    kw = dict(model="tiny", input=QUESTION, temperature=0, max_output_tokens=40, reasoning={"effort": "none"})
    assert client.responses.create(**kw).output[0].content[0].logprobs == []  # not asked: none
    r = client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=3)
    (part,) = r.output[0].content
    (lp,) = part.logprobs  # ANSWER is one token
    assert part.text == ANSWER and lp.token == ANSWER and bytes(lp.bytes).decode() == ANSWER
    assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0].token == ANSWER  # greedy: the chosen token leads
    assert lp.top_logprobs[0].logprob == lp.logprob and lp.logprob > lp.top_logprobs[1].logprob
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=40,
        logprobs=True, top_logprobs=3, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    (want,) = chat.choices[0].logprobs.content
    assert want.token == lp.token and abs(want.logprob - lp.logprob) < 1e-6
    assert [t.token for t in want.top_logprobs] == [t.token for t in lp.top_logprobs]
    events = list(client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=2,
                                          stream=True))
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [t.token for t in streamed] == [t.token for t in done.logprobs] == [ANSWER]
    assert len(done.logprobs[0].top_logprobs) == 2 and abs(done.logprobs[0].logprob - lp.logprob) < 1e-6
    assert events[-1].response.output[0].content[0].logprobs[0].token == ANSWER
    with pytest.raises(openai.BadRequestError, match="'include': unknown value 'message.logits'"):
        client.responses.create(**kw, include=["message.logits"])
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.responses.create(**kw, include=["message.output_text.logprobs"], top_logprobs=21)
    # a value naming an output this server never makes changes nothing
    assert client.responses.create(**kw, include=["reasoning.encrypted_content"]).output_text == ANSWER


def test_rejections(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_missing")
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        # required / named are served (tests/structured/test_forced_tools.py); a malformed choice is a 400.
        client.responses.create(model="tiny", input="x", tools=TOOLS, tool_choice={"type": "function"})
    with pytest.raises(openai.BadRequestError, match="input"):
        client.responses.create(model="tiny", input=[{"type": "input_image", "image_url": "x"}])


def test_store_is_bounded_lru():
    from flared.server.responses_routes import ResponseStore

    store = ResponseStore(capacity=3)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is not None  # r0 is now the most recently used
    store.put({"id": "r3"}, [])
    assert len(store) == 3 and store.get("r1") is None
    assert [store.get(k) is not None for k in ("r0", "r2", "r3")] == [True, True, True]
    assert store.delete("r2") and not store.delete("r2") and len(store) == 2



def test_truncated_call_can_still_be_continued(client):
    r = client.responses.create(model="tiny", input=QUESTION, tools=TOOLS, temperature=0, max_output_tokens=6)
    assert r.status == "incomplete" and r.output[-1].type == "function_call"
    r2 = client.responses.create(model="tiny", previous_response_id=r.id, temperature=0, max_output_tokens=40,
                                 reasoning={"effort": "none"}, input="Never mind.")
    assert r2.status == "completed" and r2.output_text == ANSWER


def _poll(client, rid: str, timeout_s: float = 30.0):
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress"):
            return r
        assert time.monotonic() < deadline, r.status
        time.sleep(0.02)


def test_a_background_response_is_polled_to_its_end(client):
    r = client.responses.create(model="tiny", input=QUESTION, temperature=0, reasoning={"effort": "none"},
                                background=True)
    assert r.status == "queued" and r.background and r.output == []
    done = _poll(client, r.id)
    assert done.status == "completed" and done.output_text == ANSWER and done.usage.output_tokens == 2
    # it continues a conversation like any stored response
    follow = client.responses.create(model="tiny", input="And tomorrow?", previous_response_id=r.id, temperature=0,
                                     reasoning={"effort": "none"})
    assert follow.status == "completed"
    with pytest.raises(openai.BadRequestError, match="ended"):
        client.responses.cancel(r.id)
    with pytest.raises(openai.BadRequestError, match="only a background"):
        client.responses.cancel(follow.id)
    with pytest.raises(openai.BadRequestError, match="store"):
        client.responses.create(model="tiny", input=QUESTION, background=True, store=False)
    with pytest.raises(openai.BadRequestError, match="background"):  # only background responses re-stream
        list(client.responses.retrieve(follow.id, stream=True))


def test_a_background_stream_can_be_picked_up_again(client):
    """background + stream: the events as a plain stream's; GET with stream=true replays them after
    starting_after (and would follow them live), the same bytes each time."""
    events = list(client.responses.create(model="tiny", input=QUESTION, temperature=0, reasoning={"effort": "none"},
                                          background=True, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    rid = events[0].response.id
    assert _poll(client, rid).output_text == ANSWER
    again = list(client.responses.retrieve(rid, stream=True, starting_after=2))
    assert [e.sequence_number for e in again] == list(range(3, len(events)))
    assert [e.type for e in again] == kinds[3:]
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events[3:]]
    assert len(list(client.responses.retrieve(rid, stream=True))) == len(events)


def test_cancelling_a_background_response_keeps_what_it_made(tiny_core_daemon):
    """On the random-weight tiny model (its greedy answer runs to the context's end), cancelled at once."""
    tiny = openai.OpenAI(base_url=tiny_core_daemon.base + "/v1", api_key="unused", max_retries=0)
    model = tiny.models.list().data[0].id
    r = tiny.responses.create(model=model, input="hello", temperature=0, max_output_tokens=200, background=True)
    live = tiny.responses.retrieve(r.id, stream=True)  # a reader following it live, from the start
    cancelled = tiny.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    followed = list(live)
    assert followed[0].type == "response.created" and followed[-1].response.status == "cancelled"
    done = _poll(tiny, r.id)
    assert done.status == "cancelled" and done.usage.output_tokens < 200
    assert tiny.responses.cancel(r.id).status == "cancelled"  # again: the same answer
    # deleted while it runs: it stops and stays deleted
    r2 = tiny.responses.create(model=model, input="hello again", temperature=0, max_output_tokens=200, background=True)
    tiny.responses.delete(r2.id)
    with pytest.raises(openai.NotFoundError):
        tiny.responses.retrieve(r2.id)
    full = _poll(tiny, tiny.responses.create(model=model, input="hello", temperature=0, max_output_tokens=200,
                                             background=True).id)
    assert full.status == "incomplete" and full.usage.output_tokens == 200
    import time

    time.sleep(0.3)
    with pytest.raises(openai.NotFoundError):
        tiny.responses.retrieve(r2.id)


def test_input_items_list_the_request_s_own_input(client):
    r = client.responses.create(model="tiny", temperature=0, reasoning={"effort": "none"}, input=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "input_text",
                                                                                 "text": QUESTION}]}])
    items = client.responses.input_items.list(r.id)
    assert [i.role for i in items.data] == ["user", "system"]  # newest first
    assert items.data[0].content[0].text == QUESTION and items.data[1].content[0].text == "Be brief."
    asc = client.responses.input_items.list(r.id, order="asc", limit=1)
    assert [i.role for i in asc.data] == ["system"] and asc.has_more
    rest = client.responses.input_items.list(r.id, order="asc", after=asc.data[0].id)
    assert [i.role for i in rest.data] == ["user"] and not rest.has_more
    plain = client.responses.create(model="tiny", input=QUESTION, temperature=0, reasoning={"effort": "none"})
    (only,) = client.responses.input_items.list(plain.id).data
    assert only.role == "user" and only.content[0].text == QUESTION and only.id.startswith("msg_")
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_missing")
