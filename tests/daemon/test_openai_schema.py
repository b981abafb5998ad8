"""OpenAI body validation: every rejection names its field."""

import pytest

from flared.errors import ErrorKind, FlareError
from flared.server.openai_schema import parse_chat, parse_completion

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return parse_chat({"model": "m", "messages": MSG, **kw})


def test_chat_defaults():
    r = chat()
    assert r.options.n == 1 and r.options.max_tokens is None and r.options.stop == ()
    assert r.add_generation_prompt and not r.continue_final_message and not r.stream


def test_content_parts_are_joined_and_max_completion_tokens_wins():
    r = parse_chat({"model": "m", "max_tokens": 5, "max_completion_tokens": 7,
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}]})
    assert r.messages[0]["content"] == "ab" and r.options.max_tokens == 7


@pytest.mark.parametrize("body, field, kind", [
    ({"messages": MSG}, "'model'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": []}, "'messages'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "'messages[0].role'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "'messages[0].content'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "'messages[0].content[0].image_url'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "'messages[0].content[0].input_audio'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "video_url"}]}]},
     "'messages[0].content[0].video_url'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "file"}]}]},
     "'messages[0].content[0]'", ErrorKind.UNSUPPORTED),
    ({"model": "m", "messages": MSG, "temperature": "hot"}, "'temperature'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "temperature": 3}, "'temperature'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "top_p": 0}, "'top_p'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "max_tokens": 0}, "'max_tokens'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "max_tokens": True}, "'max_tokens'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "n": 100}, "'n'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "stop": 5}, "'stop'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "logit_bias": {"x": 1}}, "'logit_bias'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "logit_bias": {"1": 200}}, "'logit_bias'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "top_logprobs": 2}, "'top_logprobs'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "logprobs": True, "top_logprobs": 50}, "'top_logprobs'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "stream_options": {"include_usage": True}}, "'stream_options'",
     ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "tools": [{"type": "retrieval"}]}, "'tools[0]'", ErrorKind.UNSUPPORTED),
    ({"model": "m", "messages": MSG, "tools": [{"type": "function"}]}, "'tools[0].function'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "tool_choice": "sometimes"}, "'tool_choice'", ErrorKind.VALIDATION),
    ({"model": "m", "messages": MSG, "response_format": {"type": "xml"}}, "'response_format.type'",
     ErrorKind.VALIDATION),
    ([1, 2], "'body'", ErrorKind.VALIDATION),
])
def test_chat_rejections_name_the_field(body, field, kind):
    with pytest.raises(FlareError) as e:
        parse_chat(body)
    assert str(e.value).startswith(field) and e.value.kind is kind and e.value.http_status == 400


def test_completion_prompt_forms():
    assert parse_completion({"model": "m", "prompt": "x"}).prompts == ["x"]
    assert parse_completion({"model": "m", "prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse_completion({"model": "m", "prompt": [1, 2]}).prompts == [[1, 2]]
    assert parse_completion({"model": "m", "prompt": [[1], [2, 3]]}).prompts == [[1], [2, 3]]
    for bad in (None, 3, [], [[]], [1, "a"], [True]):
        with pytest.raises(FlareError, match="'prompt'"):
            parse_completion({"model": "m", "prompt": bad})
    assert parse_completion({"model": "m", "prompt": "x", "best_of": 3}).best_of == 3
    assert parse_completion({"model": "m", "prompt": "x", "n": 2}).best_of == 2
    for bad in ({"best_of": 1, "n": 2}, {"best_of": 3, "stream": True}, {"best_of": 17}):
        with pytest.raises(FlareError, match="'best_of'"):
            parse_completion({"model": "m", "prompt": "x", **bad})
    assert parse_completion({"model": "m", "prompt": "x", "suffix": "y"}).suffix == "y"  # fill in the middle
    with pytest.raises(FlareError, match="'suffix': needs text prompts"):
        parse_completion({"model": "m", "prompt": [1, 2], "suffix": "y"})


def test_top_k_minus_one_means_off_and_stop_string_filters_empty():
    r = chat(top_k=-1, stop=["", "END"])
    assert r.options.top_k == 0 and r.options.stop == ("END",)
