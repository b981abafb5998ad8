"""llama.cpp server's own /completion and /props against the daemon serving the hand-set tool model
(tests/api/conftest.py: after " la" it writes " la" forever; after a thinking-off generation prompt it writes
the answer and stops)."""

from __future__ import annotations

import http.client
import json
import time

import pytest

ANSWER = "It is sunny in Paris."
SING = "Sing: la"


def _post(daemon, body, status=200, path="/completion"):
    got, out = daemon.request("POST", path, body)
    assert got == status, out
    return out


def _stream(daemon, body) -> list[dict]:
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    try:
        conn.request("POST", "/completion", body=json.dumps({**body, "stream": True}),
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
        text = resp.read().decode()
    finally:
        conn.close()
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert "[DONE]" not in events
    return [json.loads(e) for e in events]


def test_limit_word_and_eos(daemon):
    r = _post(daemon, {"prompt": SING, "n_predict": 5, "temperature": 0})
    assert r["content"] == " la" * 5 and r["stop"] is True and r["stop_type"] == "limit"
    assert r["tokens_predicted"] == 5 and r["tokens_evaluated"] > 0 and r["timings"]["predicted_n"] == 5
    assert r["generation_settings"]["n_predict"] == 5 and r["generation_settings"]["temperature"] == 0
    w = _post(daemon, {"prompt": SING, "n_predict": 20, "temperature": 0, "stop": ["la la"]})
    assert w["stop_type"] == "word" and w["stopping_word"] == "la la" and "la la" not in w["content"]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    _, tok = daemon.request("POST", "/tokenize", {"messages": messages,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    e = _post(daemon, {"prompt": tok["tokens"], "temperature": 0, "return_tokens": True})
    assert e["content"] == ANSWER and e["stop_type"] == "eos" and e["tokens_evaluated"] == tok["count"]
    assert len(e["tokens"]) == e["tokens_predicted"]
    # the same prompt again: reused from the prefix cache
    assert _post(daemon, {"prompt": tok["tokens"], "temperature": 0})["tokens_cached"] > 0


def test_several_prompts_answer_an_array_in_prompt_order(daemon):
    """llama.cpp's multi-prompt /completion: an array of strings, or one with token arrays among its items, is
    several prompts, each completed on its own (its own stop_type, counts and index); streamed, the chunks carry
    their prompt's index and each prompt ends with its own summary. One string in an array is one answer."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    _, tok = daemon.request("POST", "/tokenize", {"messages": messages,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    body = {"prompt": [SING, tok["tokens"], "Sing again: la"], "n_predict": 16, "temperature": 0}
    out = _post(daemon, body)
    assert isinstance(out, list) and [r["index"] for r in out] == [0, 1, 2]
    assert out[0]["content"] == " la" * 16 and out[0]["stop_type"] == "limit" and out[0]["prompt"] == SING
    assert out[1]["content"] == ANSWER and out[1]["stop_type"] == "eos" and out[1]["tokens_evaluated"] == tok["count"]
    assert out[2]["content"] == " la" * 16 and out[2]["prompt"] == "Sing again: la"
    # each one as its own request gives the same
    for k, prompt in enumerate(body["prompt"]):
        assert _post(daemon, {**body, "prompt": prompt})["content"] == out[k]["content"]
    whole = _post(daemon, {"prompt": [tok["tokens"]], "temperature": 0})  # one prompt in an array: one object
    assert isinstance(whole, dict) and whole["content"] == ANSWER and whole["stop_type"] == "eos"
    strings = _post(daemon, {"prompt": ["Sing: la", "Sing: la la"], "n_predict": 2, "temperature": 0})
    assert [r["content"] for r in strings] == [" la la"] * 2
    assert strings[0]["tokens_evaluated"] < strings[1]["tokens_evaluated"]  # not one concatenated prompt
    chunks = _stream(daemon, body)
    ends = [c for c in chunks if c["stop"]]
    assert sorted(c["index"] for c in ends) == [0, 1, 2]
    assert [c["stop_type"] for c in sorted(ends, key=lambda c: c["index"])] == ["limit", "eos", "limit"]
    for k in range(3):
        assert "".join(c["content"] for c in chunks if c["index"] == k) == out[k]["content"]


@pytest.mark.parametrize("body, needle", [
    ({"prompt": ["x", []]}, "'prompt[1]': must be a string, a {prompt_string, multimodal_data} object, or an array of "
                            "token ids"),
    ({"prompt": [[1, 10 ** 9], "x"]}, "'prompt[0]': token id 1000000000 is outside the vocabulary"),
    ({"prompt": ["x", {"a": 1}]}, "'prompt[1].prompt_string': must be a string"),
    ({"prompt": ["x"] * 17}, "at most 16 prompts per request, got 17"),
    ({"prompt": ["x", "x " * 2000]}, "'prompt[1]': 4000 tokens; this model's context holds 1024"),
])
def test_several_prompts_name_the_bad_one(daemon, body, needle):
    assert needle in _post(daemon, body, 400)["error"]["message"]


def test_typical_p_and_the_penalty_window(daemon):
    """typical_p and repeat_last_n are served (they were ignored): the settings report them, the default
    window is llama.cpp's 64, -1 is the whole context and 0 turns the penalties off."""
    body = {"prompt": SING, "n_predict": 4, "temperature": 0.7, "seed": 1, "typical_p": 0.5, "repeat_penalty": 1.3}
    r = _post(daemon, {**body, "repeat_last_n": 16})
    assert r["content"] == " la" * 4  # the loop's logit outweighs any penalty
    g = r["generation_settings"]
    assert g["typical_p"] == 0.5 and g["repeat_last_n"] == 16 and g["repeat_penalty"] == 1.3
    assert _post(daemon, body)["generation_settings"]["repeat_last_n"] == 64
    assert _post(daemon, {**body, "repeat_last_n": -1})["generation_settings"]["repeat_last_n"] == 1024
    off = _post(daemon, {**body, "repeat_last_n": 0})["generation_settings"]
    assert off["repeat_penalty"] == 1.0 and off["repeat_last_n"] == 0
    # llama.cpp's sampler order: the filters judge the distribution at temperature 1, the temperature comes last
    assert g["samplers"][-1] == "temperature" and g["samplers"][:2] == ["penalties", "dry"]
    for bad in ({"typical_p": 0}, {"typical_p": 1.5}, {"repeat_last_n": -2}):
        assert _post(daemon, {"prompt": "x", **bad}, 400)["error"]["message"].startswith(f"'{next(iter(bad))}'")


def test_the_request_sets_the_sampler_chain(daemon):
    """llama.cpp's ``samplers``: names (typical_p is typ_p) or letters, run in that order and reported back; a chain
    without penalties or dry turns them off; a name or letter flared does not run is a 400 that names them."""
    body = {"prompt": SING, "n_predict": 3, "temperature": 0.8, "seed": 3, "top_k": 5, "repeat_penalty": 1.2,
            "dry_multiplier": 0.5}
    full = _post(daemon, body)["generation_settings"]
    assert full["samplers"][-1] == "temperature" and full["repeat_penalty"] == 1.2 and full["dry_multiplier"] == 0.5
    r = _post(daemon, {**body, "samplers": ["top_k", "typical_p", "temperature"]})
    assert r["content"] == " la" * 3
    g = r["generation_settings"]
    assert g["samplers"] == ["top_k", "typ_p", "temperature"] and g["repeat_penalty"] == 1.0
    assert g["dry_multiplier"] == 0.0
    letters = _post(daemon, {**body, "samplers": "edskt", "top_n_sigma": 1.5})["generation_settings"]
    assert letters["samplers"] == ["penalties", "dry", "top_n_sigma", "top_k", "temperature"]
    assert letters["repeat_penalty"] == 1.2 and letters["top_n_sigma"] == 1.5
    # llama.cpp's other spellings: "top-k", "TopK", "temp", "nucleus"
    spelled = _post(daemon, {**body, "samplers": ["Top-K", "topk", "nucleus", "temp"]})["generation_settings"]
    assert spelled["samplers"] == ["top_k", "top_k", "top_p", "temperature"]
    # adaptive-p: the draw, with its target and decay reported
    adaptive = _post(daemon, {**body, "samplers": "ka", "adaptive_target": 0.3, "adaptive_decay": 0.8})
    assert adaptive["generation_settings"]["samplers"] == ["top_k", "adaptive_p"]
    assert adaptive["generation_settings"]["adaptive_target"] == 0.3 and adaptive["tokens_predicted"] == 3
    for bad, needle in (({"samplers": ["top_k", "mirror"]}, "unknown sampler 'mirror'"),
                        ({"samplers": "kq"}, "unknown sampler letter 'q'"), ({"samplers": 3}, "got an integer"),
                        ({"samplers": []}, "at least one")):
        err = _post(daemon, {"prompt": "x", **bad}, 400)["error"]["message"]
        assert err.startswith("'samplers'") and needle in err, err


def test_probabilities_stream_and_grammar(daemon):
    r = _post(daemon, {"prompt": SING, "n_predict": 3, "temperature": 0, "n_probs": 2})
    probs = r["completion_probabilities"]
    assert len(probs) == 3 and all(p["token"] == " la" and len(p["top_logprobs"]) == 2 for p in probs)
    assert all(p["top_logprobs"][0]["id"] == p["id"] and p["top_logprobs"][0]["logprob"] == p["logprob"]
               for p in probs)
    chunks = _stream(daemon, {"prompt": SING, "n_predict": 4, "temperature": 0, "n_probs": 1})
    assert all(not c["stop"] for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks) == " la" * 4 and chunks[-1]["stop_type"] == "limit"
    assert sum(len(c.get("completion_probabilities", [])) for c in chunks[:-1]) == 4
    assert all("timings" not in c for c in chunks[:-1])
    timed = _stream(daemon, {"prompt": SING, "n_predict": 4, "temperature": 0, "timings_per_token": True})
    counts = [c["timings"]["predicted_n"] for c in timed[:-1]]  # llama.cpp's timings on every chunk
    assert counts == sorted(counts) and counts[-1] == 4 and timed[-1]["timings"]["predicted_n"] == 4
    g = _post(daemon, {"prompt": SING, "n_predict": 20, "temperature": 0, "grammar": 'root ::= " la" " la" "!"'})
    assert g["content"] == " la la!" and g["stop_type"] == "eos"
    _, la = daemon.request("POST", "/tokenize", {"content": " la"})
    banned = _post(daemon, {"prompt": SING, "n_predict": 3, "temperature": 0,
                            "logit_bias": [[la["tokens"][0], False]]})
    assert not banned["content"].startswith(" la")
    assert _post(daemon, {"prompt": SING, "n_predict": 0})["content"] == ""


def test_post_sampling_probs(daemon):
    """llama.cpp's post_sampling_probs: each token's probability in the distribution its draw was made from (here
    top-k 2 at temperature 1: two candidates whose probabilities sum to 1), as ``prob`` and ``top_probs``; a greedy
    row's token is certain."""
    r = _post(daemon, {"prompt": "Sing:", "n_predict": 3, "temperature": 1.0, "top_k": 2, "seed": 2, "n_probs": 5,
                       "post_sampling_probs": True})
    for p in r["completion_probabilities"]:
        assert "logprob" not in p and 0 < p["prob"] <= 1 and len(p["top_probs"]) == 2
        assert sum(t["prob"] for t in p["top_probs"]) == pytest.approx(1.0, abs=1e-5)
        assert p["prob"] in [t["prob"] for t in p["top_probs"]]
    g = _post(daemon, {"prompt": SING, "n_predict": 2, "temperature": 0, "n_probs": 2, "post_sampling_probs": True})
    assert all(p["prob"] == 1.0 and p["top_probs"] == [{k: p[k] for k in ("id", "token", "bytes", "prob")}]
               for p in g["completion_probabilities"])
    chunks = _stream(daemon, {"prompt": SING, "n_predict": 2, "temperature": 0, "n_probs": 1,
                              "post_sampling_probs": True})
    assert all(p["prob"] == 1.0 for c in chunks[:-1] for p in c.get("completion_probabilities", []))


def test_props(daemon):
    status, p = daemon.request("GET", "/props")
    assert status == 200 and p["default_generation_settings"]["n_ctx"] == 1024 and p["total_slots"] >= 1
    assert "<tool_call>" in p["chat_template"] and p["modalities"]["vision"] is False
    assert p["default_generation_settings"]["params"]["samplers"][-1] == "temperature"


@pytest.mark.parametrize("body, needle", [
    ({}, "'prompt': must be a string, a {prompt_string, multimodal_data} object, or an array of token ids"),
    ({"prompt": []}, "(empty)"),
    ({"prompt": [1, 10 ** 9]}, "token id 1000000000 is outside the vocabulary"),
    ({"prompt": "x", "logit_bias": [[1]]}, "each entry must be a [token id, bias] pair"),
    ({"prompt": "x", "n_probs": 50}, "'n_probs'"),
    ({"prompt": "x", "grammar": "root ::= ("}, "invalid grammar"),
    ({"prompt": "x " * 2000}, "this model's context holds 1024"),
])
def test_errors(daemon, body, needle):
    assert needle in _post(daemon, body, 400)["error"]["message"]


def test_dry_xtc_and_mirostat(daemon):
    """llama.cpp's DRY, XTC and mirostat are served (mirostat was accepted and ignored). The model repeats " la"
    forever: DRY stops the third " la" (it would repeat `la la`), XTC at threshold 0 leaves only the least likely
    tokens, mirostat with a tiny tau keeps only the most likely (and, as in llama.cpp, takes the draw from XTC);
    the settings report each; bad values are 400s."""
    _, tok = daemon.request("POST", "/tokenize", {"content": " la"})
    (la,) = tok["tokens"]
    greedy = {"prompt": SING, "n_predict": 4, "temperature": 0, "return_tokens": True}
    dry = _post(daemon, {**greedy, "dry_multiplier": 100.0})
    assert dry["tokens"][:2] == [la, la] and dry["tokens"][2] != la
    g = dry["generation_settings"]
    assert g["dry_multiplier"] == 100.0 and g["dry_base"] == 1.75 and g["dry_allowed_length"] == 2
    assert g["dry_sequence_breakers"] == ["\n", ":", "\"", "*"] and g["dry_penalty_last_n"] == -1
    # a window of 2 tokens never holds a repeat of 2 that another token would extend
    assert _post(daemon, {**greedy, "dry_multiplier": 100.0, "dry_penalty_last_n": 2})["tokens"] == [la] * 4
    # " la" itself a breaker: no repeat reaches back over it, and it is never penalised
    assert _post(daemon, {**greedy, "dry_multiplier": 100.0, "dry_sequence_breakers": ["la"]})["tokens"] == [la] * 4
    # a breaker two tokens spell (" la" then " la": llama.cpp's restart sequence) ends each repeat at the last pair
    assert _post(daemon, {**greedy, "dry_multiplier": 100.0, "dry_sequence_breakers": ["la la"]})["tokens"] == [la] * 4
    assert _post(daemon, {**greedy, "dry_multiplier": 100.0, "dry_sequence_breakers": ["la lo"]})["tokens"][2] != la
    sampled = {**greedy, "temperature": 1.0, "seed": 5}
    assert _post(daemon, sampled)["tokens"] == [la] * 4
    xtc = {**sampled, "xtc_probability": 1.0, "xtc_threshold": 0.0}
    got = _post(daemon, xtc)
    assert la not in got["tokens"] and got["generation_settings"]["xtc_probability"] == 1.0
    miro = _post(daemon, {**xtc, "mirostat": 2, "mirostat_tau": 0.01, "mirostat_eta": 0.2})
    assert miro["tokens"] == [la] * 4
    assert miro["generation_settings"]["mirostat"] == 2 and miro["generation_settings"]["mirostat_tau"] == 0.01
    for bad in ({"mirostat": 3}, {"xtc_probability": 1.5}, {"dry_multiplier": -1}, {"dry_sequence_breakers": []},
                {"dry_sequence_breakers": [1]}, {"dry_multiplier": 1, "dry_base": 0.5}, {"dry_penalty_last_n": -2}):
        message = _post(daemon, {"prompt": "x", **bad}, 400)["error"]["message"]
        assert message.startswith(("'dry", "'mirostat", "'xtc")), message


def test_dynamic_temperature(daemon):
    """llama.cpp's dynatemp_range and dynatemp_exponent: served in its chain (here at temperature 0, which a range
    makes a draw) and on the OpenAI routes; the settings report them; a negative range is a 400."""
    _, tok = daemon.request("POST", "/tokenize", {"content": " la"})
    (la,) = tok["tokens"]
    body = {"prompt": SING, "n_predict": 4, "temperature": 0, "dynatemp_exponent": 2.0, "return_tokens": True}
    # exponent 0: the top of the range whatever the entropy, so temperature 0 with a range of 2 draws as
    # temperature 2 does, seed for seed
    for seed in range(3):
        hot = _post(daemon, {**body, "dynatemp_range": 2.0, "dynatemp_exponent": 0.0, "seed": seed})["tokens"]
        assert hot == _post(daemon, {**body, "temperature": 2.0, "seed": seed})["tokens"]
    assert _post(daemon, {**body, "dynatemp_range": 1e-4, "seed": 1})["tokens"] == [la] * 4  # ~0: the argmax
    r = _post(daemon, {**body, "dynatemp_range": 0.5})
    g = r["generation_settings"]
    assert g["dynatemp_range"] == 0.5 and g["dynatemp_exponent"] == 2.0
    status, chat = daemon.request("POST", "/v1/completions", {"model": "tiny", "prompt": SING, "max_tokens": 3,
                                                              "temperature": 0, "dynatemp_range": 1e-4})
    assert status == 200 and chat["choices"][0]["text"] == " la" * 3
    assert "'dynatemp_range'" in _post(daemon, {"prompt": "x", "dynatemp_range": -1}, 400)["error"]["message"]


def test_slots_show_the_live_requests(daemon):
    """GET /slots (llama.cpp's slot monitor): one entry per request slot; a request streaming now holds one, with
    its settings and progress, and no prompt text; slot save/restore/erase are a 400 that says why."""
    _, props = daemon.request("GET", "/props")
    status, idle = daemon.request("GET", "/slots?fail_on_no_slot=1")
    assert status == 200 and len(idle) == props["total_slots"] and not any(s["is_processing"] for s in idle)
    conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60)
    try:
        conn.request("POST", "/completion", body=json.dumps({"prompt": SING, "n_predict": 400, "temperature": 0,
                                                               "mirostat": 2, "stream": True}),
                     headers={"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")  # generating now
        _, busy = daemon.request("GET", "/slots")
        (mine,) = [s for s in busy if s["is_processing"]]
        assert mine["params"]["n_predict"] == 400 and mine["params"]["mirostat"] == 2 and mine["id_task"] >= 0
        assert mine["params"]["samplers"][-1] == "temperature"  # a /completion request: llama.cpp's order
        assert 0 < mine["next_token"]["n_decoded"] < 400 and mine["n_prompt_tokens"] > 0 and "prompt" not in mine
        assert mine["n_prompt_tokens_processed"] == mine["n_prompt_tokens"]  # decoding: the whole prompt is in
    finally:
        conn.close()
    status, err = daemon.request("POST", "/slots/0?action=save", {"filename": "x.bin"})
    assert status == 400 and "not supported" in err["error"]["message"]
    # every slot busy: fail_on_no_slot answers 503, without it the listing still comes. First every slot idle:
    # the stream closed above (or one an earlier test left) may run on until the server next writes to it
    deadline = time.monotonic() + 60
    while any(s["is_processing"] for s in daemon.request("GET", "/slots")[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    conns = [http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=60) for _ in range(props["total_slots"])]
    try:
        for c in conns:
            # 300 tokens: four requests' pages fit beside the cached prefixes (admission reserves each one's)
            c.request("POST", "/completion", body=json.dumps({"prompt": SING, "n_predict": 300, "temperature": 0,
                                                               "stream": True}),
                      headers={"content-type": "application/json"})
        held = [c.getresponse() for c in conns]  # unread: each request stays live until its connection closes
        assert all(r.status == 200 and r.readline().startswith(b"data: ") for r in held)
        status, full = daemon.request("GET", "/slots?fail_on_no_slot=1")
        assert status == 503 and full["error"]["message"] == "no slot available", full
        status, listing = daemon.request("GET", "/slots")
        assert status == 200 and sum(s["is_processing"] for s in listing) == len(listing)
    finally:
        for c in conns:
            c.close()
