"""Chat completions with tools and reasoning, through the real openai SDK against the daemon."""

from __future__ import annotations

import json

import openai
import pytest

REASONING = "Let me check the weather."
ANSWER = "It is sunny in Paris."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)


def test_tool_call_round_trip(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content is None
    assert msg.model_extra["reasoning_content"] == REASONING == msg.model_extra["reasoning"]
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the client runs the tool and sends the result back through the template; thinking off -> an answer
    history = ASK + [msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 21}'}]
    r2 = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=40,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r2.choices[0].message.content == ANSWER and r2.choices[0].finish_reason == "stop"
    assert not r2.choices[0].message.tool_calls and r2.choices[0].message.model_extra["reasoning_content"] is None
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 20  # the call and its result are in the prompt


def test_streamed_tool_call_arguments_arrive_as_deltas(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0,
                                                 max_tokens=40, stream=True))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert reasoning == REASONING and content == ""
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].type == "function"
    assert all(tc.index == 0 and tc.id is None for tc in calls[1:])
    args = [tc.function.arguments for tc in calls if tc.function.arguments]
    assert len(args) >= 2 and json.loads("".join(args)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_the_markers_stay_text_and_reasoning_is_split(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=40)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == REASONING
    assert msg.content.startswith("<tool_call>") and not msg.tool_calls and r.choices[0].finish_reason == "stop"


def test_tool_choice_none_and_rejections(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                                       max_tokens=40)
    assert not r.choices[0].message.tool_calls
    # required / named are served (tests/structured/test_forced_tools.py); malformed or unknown names are 400s.
    for bad in ({"tool_choice": {"type": "function", "function": {}}},
                {"tool_choice": {"type": "function", "function": {"name": "x"}}}):
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4, **bad)
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]"):
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4,
                                       tools=[{"type": "function", "function": {"name": ""}}])


def test_prompt_that_opens_the_reasoning(client):
    """The template's generation prompt ends inside <think>: the output starts as reasoning."""
    for stream in (False, True):
        kw = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40,
                  extra_body={"chat_template_kwargs": {"open_think": True}})
        if not stream:
            msg = client.chat.completions.create(**kw).choices[0].message
            reasoning, content = msg.model_extra["reasoning_content"], msg.content
            calls = [tc.function for tc in msg.tool_calls]
        else:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
            content = "".join(c.choices[0].delta.content or "" for c in chunks) or None
            calls = [tc.function for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if tc.id]
        assert reasoning == REASONING and content is None and calls[0].name == "get_weather"


FUNCTIONS = [t["function"] for t in TOOLS]


def test_the_deprecated_functions_round_trip(client):
    """OpenAI's deprecated function calling (``functions``, ``function_call``, ``role: function``), as older
    clients still send it: the same call as with tools, answered as ``message.function_call`` with finish reason
    "function_call", streamed as ``delta.function_call``; the history's call and result reach the template."""
    r = client.chat.completions.create(model="tiny", messages=ASK, functions=FUNCTIONS, temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and not choice.message.tool_calls
    call = choice.message.function_call
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    with_tools = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0,
                                                max_tokens=40)
    assert r.usage.prompt_tokens == with_tools.usage.prompt_tokens  # the same prompt as with tools
    history = ASK + [{"role": "assistant", "content": None, "function_call": {"name": call.name,
                                                                              "arguments": call.arguments}},
                     {"role": "function", "name": "get_weather", "content": '{"sky": "sunny", "celsius": 21}'}]
    r2 = client.chat.completions.create(model="tiny", messages=history, functions=FUNCTIONS, temperature=0,
                                        max_tokens=40, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r2.choices[0].message.content == ANSWER and r2.choices[0].finish_reason == "stop"
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 20  # the call and its result are in the prompt
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, functions=FUNCTIONS, temperature=0,
                                                 max_tokens=40, stream=True))
    pieces = [c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert pieces[0].name == "get_weather" and all(p.name is None for p in pieces[1:])
    assert json.loads("".join(p.arguments or "" for p in pieces)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "function_call"
    none = client.chat.completions.create(model="tiny", messages=ASK, functions=FUNCTIONS, function_call="none",
                                          temperature=0, max_tokens=40)
    assert none.choices[0].message.function_call is None and none.choices[0].finish_reason != "function_call"
    named = client.chat.completions.create(model="tiny", messages=ASK, functions=FUNCTIONS,
                                           function_call={"name": "get_weather"}, temperature=0, max_tokens=40)
    assert named.choices[0].message.function_call.name == "get_weather"


def test_the_deprecated_functions_beside_tools_are_a_400(client):
    with pytest.raises(openai.BadRequestError, match="'functions'"):
        client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, functions=FUNCTIONS, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="'function_call'"):
        client.chat.completions.create(model="tiny", messages=ASK, functions=FUNCTIONS, function_call="always",
                                       max_tokens=4)
