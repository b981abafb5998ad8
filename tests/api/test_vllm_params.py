"""vLLM's extra sampling parameters on /v1/chat/completions and /v1/completions, through the openai SDK's
extra_body as vLLM's users send them: min_tokens, include_stop_str_in_output, skip_special_tokens,
allowed_token_ids, truncate_prompt_tokens, return_tokens_as_token_ids, return_token_ids, request_id,
stream_options.continuous_usage_stats, cache_salt, bad_words, reasoning_effort, and chat's echo and documents (prompt_logprobs is held to transformers
in test_prompt_logprobs.py; chat's add_special_tokens in tests/frontend/test_gguf_tokenizer.py).

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


def test_bad_words_keep_a_word_out(client):
    def complete(**extra):
        return client.completions.create(model="tiny", prompt="sing la", max_tokens=6, temperature=0,
                                         extra_body=extra).choices[0]

    assert complete().text == " la" * 6  # the hand-set loop
    c = complete(bad_words=["la"])  # as a new word too: " la" (the loop's token; "la" is two tokens) is banned
    assert c.text == ANSWER and c.finish_reason == "stop"  # the model's next choice, then its EOS
    assert complete(bad_words=["sunny"]).text == " la" * 6  # other words leave it alone
    assert " la" not in complete(bad_words=["la"], min_tokens=6).text


def test_reasoning_effort_reaches_the_template(client, daemon):
    """OpenAI's reasoning_effort: "none" turns the template's thinking off (enable_thinking), any other value
    leaves it on and is passed on as reasoning_effort; explicit chat_template_kwargs win."""
    def chat(**extra):
        return client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=16,
                                              extra_body=extra).choices[0].message

    off = chat(reasoning_effort="none")
    assert off.content == ANSWER and off.model_extra["reasoning_content"] is None
    on = chat(reasoning_effort="high")
    assert on.model_extra["reasoning_content"] == "Let me check the weather." and "<tool_call>" in on.content
    kept_on = chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert kept_on.model_extra["reasoning_content"] == "Let me check the weather." 
    status, err = daemon.request("POST", "/v1/chat/completions", {"model": "tiny", "messages": ASK,
                                                                  "reasoning_effort": "max"})
    assert status == 400 and err["error"]["param"] == "reasoning_effort"


def test_chat_echo_continues_the_assistant_message(client):
    partial = ASK + [{"role": "assistant", "content": "Sure."}]
    kw = dict(model="tiny", messages=partial, temperature=0, max_tokens=4)
    extra = {**NO_THINK, "continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(**kw, extra_body=extra).choices[0].message.content
    echoed = client.chat.completions.create(**kw, extra_body={**extra, "echo": True}).choices[0].message.content
    assert echoed == "Sure." + plain
    streamed = client.chat.completions.create(**kw, stream=True, extra_body={**extra, "echo": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == echoed
    # the last message is the user's: nothing to echo
    assert _chat(client, echo=True).choices[0].message.content == ANSWER


def test_return_token_ids_request_id_and_continuous_usage(client, daemon, token_ids):
    r = _chat(client, return_token_ids=True, request_id="trace-42")
    assert r.id == "chatcmpl-trace-42"
    status, tok = daemon.request("POST", "/tokenize", {"model": "tiny", "messages": ASK,
                                                       "chat_template_kwargs": {"enable_thinking": False}})
    assert r.model_extra["prompt_token_ids"] == tok["tokens"]
    assert r.choices[0].model_extra["token_ids"] == [token_ids[ANSWER], 2]  # the answer, then EOS
    chunks = list(client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=8, stream=True,
        stream_options={"include_usage": True},
        extra_body={**NO_THINK, "return_token_ids": True, "stream_options": {"include_usage": True,
                                                                            "continuous_usage_stats": True}}))
    assert chunks[0].model_extra["prompt_token_ids"] == tok["tokens"]
    streamed_ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra.get("token_ids") or []]
    assert streamed_ids == [token_ids[ANSWER], 2]
    # every chunk carries the usage so far; the last the totals
    assert all(ch.usage is not None for ch in chunks)
    assert [ch.usage.completion_tokens for ch in chunks][-1] == 2 and chunks[0].usage.completion_tokens == 0
    c = client.completions.create(model="tiny", prompt="sing la", max_tokens=3, temperature=0,
                                  extra_body={"return_token_ids": True, "request_id": "r1"})
    assert c.id == "cmpl-r1" and c.choices[0].model_extra["token_ids"] == [token_ids[" la"]] * 3
    status, tok = daemon.request("POST", "/tokenize", {"model": "tiny", "prompt": "sing la"})
    assert c.choices[0].model_extra["prompt_token_ids"] == tok["tokens"]
    parts = list(client.completions.create(model="tiny", prompt="sing la", max_tokens=3, temperature=0, stream=True,
                                           extra_body={"return_token_ids": True}))
    assert parts[0].choices[0].model_extra["prompt_token_ids"] == tok["tokens"]
    assert [t for p in parts for t in p.choices[0].model_extra["token_ids"]] == [token_ids[" la"]] * 3


def test_cache_salt_keeps_prefixes_apart(client):
    """vLLM's cache_salt: a prompt's cached prefix serves only requests with the same salt."""
    chat = [{"role": "system", "content": "You answer questions about salted caches."}] + ASK

    def cached(**extra):
        r = client.chat.completions.create(model="tiny", messages=chat, temperature=0, max_tokens=2,
                                           extra_body={**NO_THINK, **extra})
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached() == 0  # unsalted requests do not see a salted prefix
    assert cached() > 0


# A request's own template: one user turn, then thinking already closed, so the model answers at once.
OWN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n<think>\n\n</think>{{ '\\n\\n' }}")  # (jinja drops a final newline)


@pytest.fixture(scope="module")
def trusting(tool_core, tmp_path_factory):
    """A daemon whose config trusts request chat templates."""
    from flared_testing.daemon import Daemon

    tmp = tmp_path_factory.mktemp("trusting")
    (tmp / "flared.toml").write_text("trust_request_chat_template = true\n")
    d = Daemon(tool_core, tmp, "--config", str(tmp / "flared.toml"))
    yield d
    d.kill()


def test_request_chat_template_only_where_trusted(daemon, trusting):
    body = {"model": "tiny", "messages": ASK, "max_tokens": 8, "temperature": 0, "chat_template": OWN_TEMPLATE}
    status, err = daemon.request("POST", "/v1/chat/completions", body)
    assert status == 400 and err["error"]["param"] == "chat_template"
    assert "trust_request_chat_template" in err["error"]["message"]
    status, out = trusting.request("POST", "/v1/chat/completions", body)
    assert status == 200 and out["choices"][0]["message"]["content"] == ANSWER
    # the model's own template would have thought first
    status, own = trusting.request("POST", "/v1/chat/completions", {k: v for k, v in body.items()
                                                                     if k != "chat_template"})
    assert own["choices"][0]["message"]["reasoning_content"] == "Let me check the weather."
    status, rendered = trusting.request("POST", "/apply-template", {"messages": ASK, "chat_template": OWN_TEMPLATE})
    assert rendered["prompt"] == f"<|im_start|>user\n{ASK[0]['content']}<|im_end|>\n" \
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    status, err = trusting.request("POST", "/v1/chat/completions", {**body, "chat_template": "{% for %}"})
    assert status == 400 and err["error"]["param"] == "chat_template" and "compile" in err["error"]["message"]


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
    ({"request_id": "a b"}, "request_id"),
    ({"return_token_ids": 1}, "return_token_ids"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": 5}, "cache_salt"),
    ({"bad_words": "la"}, "bad_words"),
    ({"bad_words": [" "]}, "bad_words"),
])
def test_bad_values_are_400s_naming_the_field(daemon, extra, field):
    for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "Hello"})):
        status, err = daemon.request("POST", path, {"model": "tiny", **body, **extra})
        assert status == 400, (path, extra, err)
        assert err["error"]["param"] == field and f"'{field}'" in err["error"]["message"]


def test_bad_chat_only_fields(daemon):
    for extra, field in (({"documents": "text"}, "documents"), ({"documents": [1]}, "documents"),
                         ({"echo": "yes"}, "echo"), ({"add_special_tokens": 0}, "add_special_tokens")):
        status, err = daemon.request("POST", "/v1/chat/completions", {"model": "tiny", "messages": ASK, **extra})
        assert status == 400 and err["error"]["param"] == field, (extra, err)
    # documents reach the template (this one ignores them): a well-formed list is accepted
    status, body = daemon.request("POST", "/v1/chat/completions", {
        "model": "tiny", "messages": ASK, "max_tokens": 2, "documents": [{"title": "t", "text": "x"}]})
    assert status == 200


def test_llama_cpp_samplers_through_extra_body(client):
    """llama.cpp's OpenAI-compatible routes take its DRY, XTC and mirostat fields too: here DRY ends the loop."""
    plain = client.completions.create(model="tiny", prompt="Sing: la", max_tokens=4, temperature=0)
    assert plain.choices[0].text == " la" * 4
    dry = client.completions.create(model="tiny", prompt="Sing: la", max_tokens=4, temperature=0,
                                    extra_body={"dry_multiplier": 100.0, "return_token_ids": True})
    ids = dry.choices[0].model_extra["token_ids"]
    assert ids[0] == ids[1] and ids[2] != ids[0] and dry.choices[0].text.startswith(" la la")
    with pytest.raises(openai.BadRequestError, match="mirostat"):
        _chat(client, mirostat=7)


def test_priority_is_accepted_and_checked(client):
    """vLLM's priority (its effect on admission and selection is tested in tests/scheduler)."""
    assert _chat(client, priority=-5).choices[0].message.content == ANSWER
    assert client.completions.create(model="tiny", prompt="Sing: la", max_tokens=2, temperature=0,
                                     extra_body={"priority": 3}).choices[0].text == " la la"
    with pytest.raises(openai.BadRequestError, match="priority"):
        _chat(client, priority="high")


def test_the_x_request_id_header_names_the_answer(client):
    """As vLLM: without a body request_id, the client's X-Request-Id makes the answer's id, and is echoed."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=4, extra_body=NO_THINK,
        extra_headers={"X-Request-Id": "trace-7"})
    assert raw.headers["x-request-id"] == "trace-7" and raw.parse().id == "chatcmpl-trace-7"
    body_wins = _chat(client, request_id="from-body")
    assert body_wins.id == "chatcmpl-from-body"
    raw = client.completions.with_raw_response.create(model="tiny", prompt="Sing: la", max_tokens=2,
                                                      extra_headers={"X-Request-Id": "trace-8"})
    assert raw.parse().id == "cmpl-trace-8"
