"""/tokenize and /detokenize (vLLM's and llama.cpp server's shapes) against the daemon: the counts are the
prompts the generation routes run."""

from __future__ import annotations

import openai
import pytest

QUESTION = "What is the weather in Paris?"
TEXT = "Hello, world! <think> It is sunny in Paris."  # a special token and an added token inside


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)


def _post(daemon, path, body, status=200):
    got, out = daemon.request("POST", path, body)
    assert got == status, out
    return out


def test_prompt_and_messages_count_what_generation_runs(daemon, client):
    t = _post(daemon, "/tokenize", {"model": "tiny", "prompt": QUESTION})
    done = client.completions.create(model="tiny", prompt=QUESTION, max_tokens=1)
    assert t["count"] == len(t["tokens"]) == done.usage.prompt_tokens and t["max_model_len"] == 1024
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    m = _post(daemon, "/tokenize", {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert m["count"] == chat.usage.prompt_tokens
    no_prompt = _post(daemon, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert no_prompt["tokens"] == m["tokens"][:no_prompt["count"]] and no_prompt["count"] < m["count"]


def test_apply_template_renders_what_chat_runs(daemon):
    """llama.cpp's /apply-template: the rendered prompt, whose tokens are the ones /tokenize (and chat) run."""
    messages = [{"role": "user", "content": QUESTION}]
    for extra in ({}, {"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}):
        prompt = _post(daemon, "/apply-template", {"messages": messages, **extra})["prompt"]
        assert prompt.startswith("<|im_start|>user\n" + QUESTION) and "<|im_start|>assistant\n" in prompt
        assert ("<think>" in prompt) == bool(extra)  # thinking off: the template writes an empty think block
        ids = _post(daemon, "/tokenize", {"content": prompt})["tokens"]
        assert ids == _post(daemon, "/tokenize", {"messages": messages, **extra})["tokens"]
    err = _post(daemon, "/apply-template", {"prompt": "x"}, status=400)
    assert "'messages'" in err["error"]["message"]


def test_pieces_strings_and_the_round_trip(daemon):
    t = _post(daemon, "/tokenize", {"content": TEXT, "with_pieces": True})
    ids = [p["id"] for p in t["tokens"]]
    assert "".join(p["piece"] for p in t["tokens"]) == TEXT
    assert any(p["piece"] == "<think>" for p in t["tokens"])  # special tokens are matched in the text
    v = _post(daemon, "/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert v["tokens"] == ids and "".join(v["token_strs"]) == TEXT  # this model takes no BOS
    d = _post(daemon, "/detokenize", {"model": "tiny", "tokens": ids})
    assert d["prompt"] == d["content"] == TEXT
    assert _post(daemon, "/detokenize", {"tokens": []})["content"] == ""


@pytest.mark.parametrize("path, body, status, needle", [
    ("/tokenize", {"prompt": "a", "content": "b"}, 400, "exactly one of 'prompt', 'content' or 'messages'"),
    ("/tokenize", {}, 400, "exactly one of"),
    ("/tokenize", {"prompt": 3}, 400, "'prompt': must be a string"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model 'gpt-4' does not exist"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, 400, "token id 1000000000 is outside the vocabulary"),
    ("/detokenize", {"tokens": "1 2"}, 400, "'tokens': must be an array of token ids"),
])
def test_errors_name_the_field(daemon, path, body, status, needle):
    out = _post(daemon, path, body, status)
    assert needle in out["error"]["message"]
