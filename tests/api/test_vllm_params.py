"""vLLM's extra sampling parameters on /v1/chat/completions and /v1/completions, through the openai SDK's
extra_body as vLLM's users send them: min_tokens, include_stop_str_in_output, skip_special_tokens,
allowed_token_ids, truncate_prompt_tokens, return_tokens_as_token_ids (prompt_logprobs is held to transformers
in test_prompt_logprobs.py).

The tool model's greedy output is known (tests/api/conftest.py): with thinking off it answers
"It is sunny in Paris." and then its EOS (<|im_end|>); after " la" it repeats " la" forever."""

from __future__ import annotations

import openai
import pytest

ANSWER = "It is sunny in Paris."
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)


def _chat(client, **extra):
    return client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=8,
                                          extra_body={**NO_THINK, **extra})


def test_min_tokens_keeps_eos_from_ending_the_answer(client):
    plain = _chat(client)
    assert plain.choices[0].message.content == ANSWER and plain.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens == 2  # the answer's token, then EOS
    longer = _chat(client, min_tokens=6, max_tokens=6)
    (c,) = longer.choices
    assert c.message.content.startswith(ANSWER) and len(c.message.content) > len(ANSWER)
    assert c.finish_reason == "length" and longer.usage.completion_tokens == 6
    streamed = client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=6, stream=True,
                                              extra_body={**NO_THINK, "min_tokens": 6})
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == c.message.content
    # min_tokens already met: EOS ends the answer as before
    assert _chat(client, min_tokens=1).choices[0].message.content == ANSWER


def test_min_tokens_defers_stop_strings(client):
    def complete(**extra):
        r = client.completions.create(model="tiny", prompt="sing la", max_tokens=8, temperature=0, stop=["la"],
                                      extra_body=extra)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    assert complete() == (" ", "stop", 1)  # " la" completes the stop string at once
    assert complete(min_tokens=3) == (" la la ", "stop", 3)  # none looked for before the third token
    assert complete(include_stop_str_in_output=True) == (" la", "stop", 1)
    assert complete(min_tokens=3, include_stop_str_in_output=True) == (" la la la", "stop", 3)


def test_special_tokens_and_the_stop_token_in_the_text(client):
    kept = _chat(client, skip_special_tokens=False)
    assert kept.choices[0].message.content == ANSWER  # the EOS that ended it is still withheld
    both = _chat(client, skip_special_tokens=False, include_stop_str_in_output=True)
    assert both.choices[0].message.content == ANSWER + "<|im_end|>"
    # a skipped special token has no text to include
    assert _chat(client, include_stop_str_in_output=True).choices[0].message.content == ANSWER


def test_allowed_token_ids_and_token_ids_in_logprobs(client, token_ids):
    allowed = [token_ids[" la"], token_ids[ANSWER]]
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=1.0, seed=3, logprobs=2,
                                  extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True})
    (c,) = r.choices
    ids = [int(t.removeprefix("token_id:")) for t in c.logprobs.tokens]
    assert len(ids) == 6 and set(ids) <= set(allowed)
    assert all(k.startswith("token_id:") for top in c.logprobs.top_logprobs for k in top)
    chat = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=3, logprobs=True, top_logprobs=1,
                                          extra_body={**NO_THINK, "allowed_token_ids": allowed,
                                                      "return_tokens_as_token_ids": True})
    tokens = [lp.token for lp in chat.choices[0].logprobs.content]
    assert tokens and all(int(t.removeprefix("token_id:")) in allowed for t in tokens)


def test_truncate_prompt_tokens_keeps_the_prompt_end(client, daemon):
    status, tok = daemon.request("POST", "/tokenize", {"model": "tiny", "prompt": "Paris is the capital of France."})
    assert status == 200 and len(tok["tokens"]) > 4
    ids = tok["tokens"]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    status, tail = daemon.request("POST", "/detokenize", {"model": "tiny", "tokens": ids[-3:]})
    assert r.choices[0].text.startswith(tail["prompt"])
    # chat: the rendered prompt's last k tokens; -1 keeps what fits the context
    assert _chat(client, truncate_prompt_tokens=5).usage.prompt_tokens == 5
    full = _chat(client).usage.prompt_tokens
    assert _chat(client, truncate_prompt_tokens=-1).usage.prompt_tokens == full


@pytest.mark.parametrize("extra, field", [
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, "a"]}, "allowed_token_ids"),
    ({"allowed_token_ids": [10 ** 6]}, "allowed_token_ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 99}, "prompt_logprobs"),
])
def test_bad_values_are_400s_naming_the_field(daemon, extra, field):
    for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "Hello"})):
        status, err = daemon.request("POST", path, {"model": "tiny", **body, **extra})
        assert status == 400, (path, extra, err)
        assert err["error"]["param"] == field and f"'{field}'" in err["error"]["message"]
