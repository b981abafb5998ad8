"""Ollama routes through the real ollama Python client against the daemon."""

from __future__ import annotations

import json

import ollama
import pytest

REASONING = "Let me check the weather."
ANSWER = "It is sunny in Paris."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "num_predict": 40}


@pytest.fixture(scope="module")
def client(daemon):
    return ollama.Client(host=daemon.base)


def test_discovery(client, daemon):
    names = [m.model for m in client.list().models]
    assert "tiny" in names
    info = client.show("tiny:latest")
    assert set(info.capabilities) == {"completion", "tools", "thinking"}
    assert info.modelinfo["llama.context_length"] == 1024 and "<tool_call>" in info.template
    status, body = daemon.request("GET", "/api/version")
    assert status == 200 and body["version"]
    (running,) = client.ps().models
    assert running.context_length == 1024 and running.size > 0


def test_model_management_routes(client, daemon):
    """What Ollama's clients call around generation: pulling the served model succeeds (streamed or not), any
    other model is a 404 naming the served one, and creating, copying, pushing or deleting says it is not
    supported; GET / answers as an Ollama server does."""
    assert client.pull("tiny").status == "success"
    assert [p.status for p in client.pull("tiny:latest", stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError) as info:
        client.pull("llama3.2:1b")
    assert info.value.status_code == 404 and "this server serves" in info.value.error
    for call in (lambda: client.delete("tiny"), lambda: client.copy("tiny", "mine"),
                 lambda: client.create("mine", from_="tiny"), lambda: client.push("tiny")):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 400 and "not supported" in info.value.error
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(daemon.base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request("GET", "/")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == b"Ollama is running"
    conn.close()


def test_typical_p_and_repeat_last_n_options(client, daemon):
    """Ollama's typical_p and repeat_last_n are served (they were ignored); bad values are 400s."""
    opts = {"temperature": 0.7, "seed": 3, "num_predict": 4, "typical_p": 0.5, "repeat_last_n": 8,
            "repeat_penalty": 1.2, "frequency_penalty": 0.5}
    r = client.generate(model="tiny", prompt="Sing: la", raw=True, options=opts)
    assert r.done and r.response == " la" * 4
    for bad in ({"typical_p": 0}, {"repeat_last_n": -5}):
        status, err = daemon.request("POST", "/api/generate", {"model": "tiny", "prompt": "x", "stream": False,
                                                              "options": bad})
        assert status == 400 and next(iter(bad)) in err["error"], err


def test_chat_tool_round_trip(client):
    r = client.chat(model="tiny", messages=ASK, tools=TOOLS, options=GREEDY)
    assert r.done and r.done_reason == "stop" and r.eval_count == 9 and r.prompt_eval_count > 0
    assert r.message.thinking == REASONING and r.message.content == ""
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    history = ASK + [r.message.model_dump(exclude_none=True),
                     {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
    r2 = client.chat(model="tiny", messages=history, tools=TOOLS, options=GREEDY, think=False)
    assert r2.message.content == ANSWER and not r2.message.tool_calls and r2.prompt_eval_count > r.prompt_eval_count


def test_chat_stream(client):
    parts = list(client.chat(model="tiny", messages=ASK, tools=TOOLS, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "stop"
    assert "".join(p.message.thinking or "" for p in parts) == REASONING
    assert "".join(p.message.content or "" for p in parts) == ""
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_generate_and_options(client):
    r = client.generate(model="tiny", prompt="What is the weather in Paris?", think=False, options=GREEDY)
    assert r.response == ANSWER and r.done_reason == "stop"
    parts = list(client.generate(model="tiny", prompt="What is the weather in Paris?", think=False,
                                 options={"temperature": 0, "num_predict": 1}, stream=True))
    assert "".join(p.response for p in parts) == ANSWER and parts[-1].done_reason == "length"
    r = client.generate(model="tiny", prompt="What is the weather in Paris?", think=False,
                        options={"temperature": 0, "stop": ["sunny"]})
    assert r.response == "It is "
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="tiny", prompt="hi", options={"num_ctx": 4096})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=ASK)
    assert e.value.status_code == 404


def test_prompts_past_num_ctx_are_cut_as_ollama_cuts_them(client, daemon):
    """A chat whose history does not fit num_ctx keeps its system message and latest messages (Ollama's
    chatPrompt), as many as leave num_predict free; a prompt still too long its first num_keep tokens and its end,
    half the context; the answer (a function of the prompt's end here) is the one without the cut. ``truncate:
    false`` is a 400 instead."""
    system = {"role": "system", "content": "You are terse."}
    history = [m for i in range(30) for m in ({"role": "user", "content": f"Question {i} about the weather?"},
                                              {"role": "assistant", "content": f"Answer {i}: it is mild."})]
    messages = [system, *history, *ASK]
    options = {"temperature": 0, "num_predict": 40, "num_ctx": 160}
    r = client.chat(model="tiny", messages=messages, think=False, options=options)
    assert r.message.content == ANSWER and r.prompt_eval_count <= 160 - 40  # num_predict's room left
    whole = client.chat(model="tiny", messages=messages, think=False, options=dict(options, num_ctx=1024))
    assert whole.message.content == ANSWER and whole.prompt_eval_count > 160  # the same without the cut
    status, body = daemon.request("POST", "/api/chat", {"model": "tiny", "messages": messages, "think": False,
                                                         "stream": False, "options": options, "truncate": False})
    assert status == 400 and "num_ctx 160" in body["error"]
    long_prompt = "word " * 400 + "What is the weather in Paris?"
    r = client.generate(model="tiny", prompt=long_prompt, think=False, options=dict(options, num_keep=8))
    assert r.response == ANSWER and r.prompt_eval_count == 8 + (160 - 8) // 2


def test_format_json_is_enforced(client):
    r = client.generate(model="tiny", prompt="Give me JSON.", think=False, format="json",
                        options={"temperature": 0, "num_predict": 30})
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.response), dict)


def test_logprobs(client):
    """logprobs / top_logprobs (Ollama 0.12.11+): per generated token its text, log probability and the most
    likely alternatives, streamed with the tokens they belong to."""
    ask = {"model": "tiny", "prompt": "What is the weather in Paris?", "think": False, "options": GREEDY}
    r = client.generate(**ask, logprobs=True, top_logprobs=2)
    assert r.response == ANSWER and "".join(lp.token for lp in r.logprobs) == ANSWER
    for lp in r.logprobs:  # greedy: the token taken is the most likely one
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 2
        assert lp.top_logprobs[0].token == lp.token and lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
    parts = list(client.generate(**ask, logprobs=True, top_logprobs=2, stream=True))
    streamed = [lp for p in parts for lp in (p.logprobs or [])]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in r.logprobs]
    c = client.chat(model="tiny", messages=ASK, think=False, options=GREEDY, logprobs=True)
    assert c.message.content == ANSWER and c.logprobs and not c.logprobs[0].top_logprobs
    assert client.generate(**ask).logprobs is None
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(**ask, top_logprobs=3)
    assert e.value.status_code == 400 and "logprobs" in e.value.error


def _cancelled_total(daemon) -> float:
    status, text = daemon.request("GET", "/metrics")
    assert status == 200
    for line in text.decode().splitlines():
        if line.startswith("flare_model_requests_cancelled_total"):
            return float(line.split()[-1])
    raise AssertionError("no cancelled counter")


def test_disconnect_mid_stream_cancels(client, daemon):
    import http.client
    import time

    body = {"model": "tiny", "prompt": "Sing la la", "raw": True, "options": {"temperature": 0, "num_predict": 600}}
    full = client.generate(**body)
    assert full.eval_count == 600 and full.response == " la" * 600  # this prompt does not reach EOS
    before = _cancelled_total(daemon)
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    conn.request("POST", "/api/generate", body=json.dumps({**body, "stream": True}),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.read(20).startswith(b'{"model"')  # the stream has begun
    conn.close()
    deadline = time.monotonic() + 30
    while _cancelled_total(daemon) == before:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.05)  # polling the daemon's own counter until the model thread records the cancel


def test_generate_context_continues_an_exchange(client, daemon):
    """/api/generate's context: the exchange's tokens (prompt, then the answer without its stop token); passed
    back, the next prompt continues after them, and the prefix cache reuses them."""
    first = client.generate(model="tiny", prompt="Sing: la", raw=True, options={"temperature": 0, "num_predict": 3})
    assert first.response == " la" * 3
    _, tok = daemon.request("POST", "/tokenize", {"prompt": "Sing: la", "add_special_tokens": False})
    la = tok["tokens"][-1]
    assert first.context == tok["tokens"] + [la] * 3
    # raw continuation: the context, then " la" again; the loop goes on
    again = client.generate(model="tiny", prompt=" la", raw=True, context=first.context,
                            options={"temperature": 0, "num_predict": 2})
    assert again.response == " la" * 2 and again.prompt_eval_count == len(first.context) + 1
    assert again.context == first.context + [la] * 3
    # streamed, the last line carries it too
    parts = list(client.generate(model="tiny", prompt="Sing: la", raw=True, stream=True,
                                 options={"temperature": 0, "num_predict": 3}))
    assert parts[-1].done and parts[-1].context == first.context
    # an answer that ended on its EOS leaves it out; chat has no context
    ended = client.generate(model="tiny", prompt="What is the weather in Paris?", think=False,
                            options={"temperature": 0})
    assert ended.response == ANSWER and len(ended.context) == ended.prompt_eval_count + 1
    for bad in ([-1], "x", [10 ** 9]):
        status, err = daemon.request("POST", "/api/generate", {"model": "tiny", "prompt": "x", "stream": False,
                                                              "context": bad})
        assert status == 400 and "context" in err["error"]


def test_mirostat_and_dry_options(client, daemon):
    """Ollama's mirostat options are served (they were ignored), as are llama.cpp's DRY options by their names."""
    base = {"temperature": 0, "num_predict": 4}
    plain = client.generate(model="tiny", prompt="Sing: la", raw=True, options=base)
    dry = client.generate(model="tiny", prompt="Sing: la", raw=True, options={**base, "dry_multiplier": 100.0})
    # context: the prompt's ids, then the answer's; a " la" that would repeat `la la` is gone
    la, prompt = plain.context[-1], len(plain.context) - 4
    answer = dry.context[prompt:]
    assert plain.context[prompt:] == [la] * 4 and dry.done and answer[:2] == [la, la] and answer != [la] * 4
    miro = client.generate(model="tiny", prompt="Sing: la", raw=True,
                           options={"temperature": 1.5, "seed": 2, "num_predict": 4, "mirostat": 2,
                                    "mirostat_tau": 0.01, "mirostat_eta": 0.1})
    assert miro.done and miro.response == " la" * 4
    for bad in ({"mirostat": 5}, {"mirostat_eta": -1}):
        status, err = daemon.request("POST", "/api/generate", {"model": "tiny", "prompt": "x", "stream": False,
                                                              "options": bad})
        assert status == 400 and next(iter(bad)) in err["error"], err
