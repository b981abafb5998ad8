"""vLLM's and llama.cpp server's output constraints (structured_outputs / guided_* ; grammar, json_schema)
through the openai SDK's extra_body against a daemon serving a random-weight model: whatever the weights
want, the text must match."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}
GBNF = 'root ::= answer " " digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
LARK = 'start: ANSWER " " DIGIT\nANSWER: "yes" | "no"\nDIGIT: /[0-9]/'


@pytest.fixture(scope="module")
def client(tiny_daemon):
    return openai.OpenAI(base_url=tiny_daemon.base + "/v1", api_key="unused", max_retries=0)


def _chat(client, extra, **kw):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Answer."}],
                                       max_tokens=60, extra_body=extra, **kw)
    return r.choices[0].message.content, r.choices[0].finish_reason


def _completion(client, extra, **kw):
    r = client.completions.create(model="tiny", prompt="Answer:", max_tokens=60, extra_body=extra, **kw)
    return r.choices[0].text, r.choices[0].finish_reason


@pytest.mark.parametrize("route", [_chat, _completion])
@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ({"structured_outputs": {"regex": r"(ab|cd){2}!"}}, lambda t: re.fullmatch(r"(ab|cd){2}!", t)),
    ({"guided_choice": ["red", "green", "blue \"sky\""]}, lambda t: t in ("red", "green", 'blue "sky"')),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"grammar": GBNF}, lambda t: re.fullmatch(r"(yes|no) [0-9]", t)),  # llama.cpp's GBNF
    ({"guided_grammar": LARK}, lambda t: re.fullmatch(r"(yes|no) [0-9]", t)),
    ({"structured_outputs": {"grammar": GBNF}}, lambda t: re.fullmatch(r"(yes|no) [0-9]", t)),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"json_schema": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),  # llama.cpp's
    ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_constrained_text_matches(client, route, extra, check):
    for seed in (1, 2):
        text, finish = route(client, extra, temperature=1.0, seed=seed)
        assert finish == "stop" and check(text), (extra, text)


def test_json_object_mode(client):
    """Any JSON object: a random model's strings may run past max_tokens, so only the start is certain then."""
    for seed in (1, 2, 3):
        text, finish = _chat(client, {"structured_outputs": {"json_object": True}}, temperature=1.0, seed=seed)
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("extra, needle", [
    ({"guided_regex": r"[0-9]+", "guided_choice": ["a"]}, "one output constraint per request; this one has "
                                                         "guided_regex, guided_choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex, response_format"),
    ({"guided_choice": []}, "'guided_choice': must be an array of 1 to 1024 non-empty strings"),
    ({"guided_choice": ["a", ""]}, "non-empty strings"),
    ({"guided_regex": ""}, "'guided_regex': must be a non-empty string"),
    ({"guided_json": "{not json"}, "'guided_json': is not a JSON schema"),
    ({"structured_outputs": "json"}, "'structured_outputs': must be an object"),
    ({"structured_outputs": {"json_object": 1}}, "'structured_outputs.json_object': must be true"),
    ({"grammar": "root ::= ("}, "invalid grammar"),
    ({"guided_regex": "(unclosed"}, "invalid grammar"),
    ({"guided_choice": ["a"], "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "a forced tool call cannot be combined"),
])
def test_bad_constraints_are_400(client, extra, needle):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, extra)
    assert needle in str(e.value)
