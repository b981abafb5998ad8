"""Forced tool calls through the grammar: OpenAI tool_choice required / named,
Anthropic tool_choice any / tool (and its output_config.format, the Messages
API's structured output), with the real SDKs against the tiny daemon.

The tiny model has random weights: whatever it would say, the grammar makes
the output a call to an allowed tool with arguments valid for its schema.
"""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}},
         "required": ["zone"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": s}} for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def oai(tiny_daemon):
    return openai.OpenAI(base_url=tiny_daemon.base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(tiny_daemon):
    return anthropic.Anthropic(base_url=tiny_daemon.base, api_key="unused", max_retries=0)


def _valid(name: str, arguments) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])


def test_openai_required_and_named(oai):
    for seed in range(3):
        # One call per answer: a random-weight model would otherwise keep appending calls.
        r = oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                        max_tokens=120, temperature=1.0, seed=seed, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            _valid(call.function.name, call.function.arguments)
    r = oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                                    tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and call.id.startswith("call_")
    _valid("get_time", call.function.arguments)


def test_openai_named_streams_argument_deltas(oai):
    stream = oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                                         stream=True,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    names, pieces, finish = [], [], None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or ():
            if tc.function.name:
                names.append(tc.function.name)
            pieces.append(tc.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert sum(1 for p in pieces if p) > 1  # arguments arrive in several deltas
    _valid("get_weather", "".join(pieces))


def test_openai_forced_call_rejections(oai):
    with pytest.raises(openai.BadRequestError, match="not among 'tools'"):
        oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4, tool_choice="required",
                                    response_format={"type": "json_object"})
    bad_tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "not": {"const": 3}}}}}}]
    with pytest.raises(openai.BadRequestError, match="'not'"):
        oai.chat.completions.create(model="tiny", messages=ASK, tools=bad_tools, max_tokens=4, tool_choice="required")


def test_anthropic_any_and_tool(claude):
    a_tools = [{"name": n, "description": n, "input_schema": s} for n, s in SCHEMAS.items()]
    r = claude.messages.create(model="tiny", max_tokens=120, messages=ASK, tools=a_tools,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(uses) == 1
    for b in uses:
        _valid(b.name, b.input)
    with claude.messages.stream(model="tiny", max_tokens=60, messages=ASK, tools=a_tools,
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:
        final = s.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "get_weather" and final.stop_reason == "tool_use"
    _valid("get_weather", use.input)


def test_anthropic_output_config_format(claude):
    """Structured outputs as the current SDK asks for them: output_config.format, a JSON schema; the reply is
    text holding JSON valid under it, streamed or not, tools offered or not."""
    weather = {"format": {"type": "json_schema", "schema": WEATHER}}
    r = claude.messages.create(model="tiny", max_tokens=80, messages=ASK, output_config=weather)
    (block,) = r.content
    assert block.type == "text" and r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(block.text), WEATHER)
    a_tools = [{"name": n, "description": n, "input_schema": s} for n, s in SCHEMAS.items()]
    with claude.messages.stream(model="tiny", max_tokens=80, messages=ASK, tools=a_tools,
                                output_config={"effort": "low", **weather}) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text"] and final.stop_reason == "end_turn"
    jsonschema.validate(json.loads(final.content[0].text), WEATHER)
    # The SDK's parse helper sends a pydantic model's schema the same way and validates the reply into it (it
    # moves numeric bounds into descriptions, which no grammar enforces, so this model has none).
    import pydantic

    class Weather(pydantic.BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]
        days: int

    parsed = claude.messages.parse(model="tiny", max_tokens=80, messages=ASK, output_format=Weather).parsed_output
    assert isinstance(parsed, Weather) and parsed.city in ("Paris", "Rome", "Oslo")
    # The structured-outputs beta put the same object at the top level.
    r = claude.messages.create(model="tiny", max_tokens=40, messages=ASK,
                               extra_body={"output_format": {"type": "json_schema", "schema": CLOCK}})
    jsonschema.validate(json.loads(r.content[0].text), CLOCK)


@pytest.mark.parametrize("extra, match", [
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"not": {"type": "null"}}}}}, "'not'"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"output_config": "json"}, "output_config"),
    ({"output_config": {"format": {"type": "json_schema", "schema": CLOCK}},
      "output_format": {"type": "json_schema", "schema": CLOCK}}, "output_format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": CLOCK}},
      "tools": [{"name": "get_time", "input_schema": CLOCK}], "tool_choice": {"type": "any"}}, "forced tool_choice"),
])
def test_anthropic_output_format_rejections(claude, extra, match):
    with pytest.raises(anthropic.BadRequestError, match=match) as info:
        claude.messages.create(model="tiny", max_tokens=4, messages=ASK, extra_body=extra)
    assert info.value.status_code == 400 and info.value.body["error"]["type"] == "invalid_request_error"


def test_responses_forced_calls_and_text_format(oai):
    r_tools = [{"type": "function", "name": n, "description": n, "parameters": s} for n, s in SCHEMAS.items()]
    r = oai.responses.create(model="tiny", input="Weather in Oslo?", tools=r_tools, tool_choice="required",
                             parallel_tool_calls=False, max_output_tokens=120)
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1
    _valid(calls[0].name, calls[0].arguments)
    r = oai.responses.create(model="tiny", input="Time?", tools=r_tools, max_output_tokens=60,
                             tool_choice={"type": "function", "name": "get_time"})
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_time"
    _valid("get_time", call.arguments)
    r = oai.responses.create(model="tiny", input="Weather as JSON.", max_output_tokens=60,
                             text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    with pytest.raises(openai.BadRequestError, match="'uniqueItems'"):
        oai.responses.create(model="tiny", input="x", max_output_tokens=4, text={"format": {
            "type": "json_schema", "name": "u", "schema": {"type": "array", "uniqueItems": True}}})


def test_tool_history_on_a_template_without_tools_is_a_clear_400(smol_daemon):
    """SmolLM2's template has no tools: a conversation carrying a call and its result is refused with a message
    that says so (the template's own failure is kept in parentheses), on both APIs."""
    claude = anthropic.Anthropic(base_url=smol_daemon.base, api_key="unused", max_retries=0)
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Paris", "days": 1}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    with pytest.raises(anthropic.BadRequestError, match="no tool-call format to render them") as info:
        claude.messages.create(model="smollm2-135m-instruct", max_tokens=4, messages=history)
    assert info.value.body["error"]["type"] == "invalid_request_error"
    oai = openai.OpenAI(base_url=smol_daemon.base + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 1}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with pytest.raises(openai.BadRequestError, match="no tool-call format to render them") as err:
        oai.chat.completions.create(model="smollm2-135m-instruct", max_tokens=4, messages=messages)
    assert err.value.body["param"] == "messages"
    # The same template renders plain turns as before.
    r = oai.chat.completions.create(model="smollm2-135m-instruct", max_tokens=4, messages=messages[:1])
    assert r.choices[0].message.content


def _forced_parser():
    from flared.server.structured import ForcedToolParser

    return type("AnyTool", (ForcedToolParser,), {"forced_name": None})(TOOLS)


def test_any_tool_calls_are_announced_as_each_completes():
    """tool_choice required / any: each call of the array is announced whole once its object closes (a stream sees
    the first while the second is written), arguments re-serialised from the parsed JSON, the brackets and commas
    never content."""
    first = '{"name":"get_weather","arguments":{"city":"Paris","days":3}}'
    second = '{"name":"get_time","arguments":{"zone":"CET"}}'
    text = "[" + first + ", " + second + "]"
    parser = _forced_parser()
    seen = []
    for i in range(0, len(text), 5):  # token-sized pieces
        out = parser.push(text[i:i + 5])
        assert out.content == ""
        seen += [(i, c.name, c.arguments) for c in out.calls]
    end = parser.finish()
    assert end.content == "" and not end.calls
    assert [(name, json.loads(args)) for _, name, args in seen] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]
    assert seen[0][0] < len(first) + 5 < seen[1][0]  # the first came out before the second was written
    assert [c.name for c in parser.calls] == ["get_weather", "get_time"] and parser.num_closed == 2


def test_any_tool_output_cut_short_keeps_its_complete_calls():
    """Cut by max_tokens: the calls completed before the cut are calls, the unfinished one is content; with no
    complete call the whole output is content, as before."""
    parser = _forced_parser()
    out = parser.parse('[{"name":"get_time","arguments":{"zone":"UTC"}},{"name":"get_weather","argu')
    assert [c.name for c in out.calls] == ["get_time"] and json.loads(out.calls[0].arguments) == {"zone": "UTC"}
    assert out.content == '{"name":"get_weather","argu'
    parser = _forced_parser()
    out = parser.parse('[{"name":"get_time","argum')
    assert not out.calls and out.content == '[{"name":"get_time","argum'
