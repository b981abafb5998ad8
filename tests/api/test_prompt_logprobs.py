"""echo with logprobs on /v1/completions, as lm-evaluation-harness scores continuations through the openai
client: every prompt token's logprob after the first, equal to transformers' on the same weights. Also what needs
this random-weight model's diverse draws or its template without tools: best_of, and functions' 400."""

from __future__ import annotations

import openai
import pytest
import torch

PROMPT = "Paris is the capital of France. The quick brown fox"


@pytest.fixture(scope="module")
def daemon(tiny_core_daemon):
    return tiny_core_daemon


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_hf_llama):
    """Token ids of PROMPT and transformers' log-softmax of the next-token logits at every position."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    ids = Tokenizer.from_file(str(tiny_hf_llama / "tokenizer.json")).encode(PROMPT).ids
    hf = AutoModelForCausalLM.from_pretrained(tiny_hf_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        lps = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return ids, lps


def test_echo_logprobs_score_the_prompt_as_transformers_does(client, reference):
    ids, ref = reference
    # lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, one new token
    r = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    (c,) = r.choices
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert c.text.startswith(PROMPT) and "".join(lp.tokens) == c.text
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < 1e-4
        (best,) = lp.top_logprobs[p].items()
        assert abs(best[1] - ref[p - 1].max().item()) < 1e-4
    # the generated token: greedy, so the argmax after the whole prompt
    assert abs(lp.token_logprobs[-1] - ref[-1].max().item()) < 1e-4
    # the harness's is_greedy over the continuation (here: the last 4 prompt tokens)
    greedy = all(max(t, key=t.get) == tok for t, tok in zip(lp.top_logprobs[-5:-1], lp.tokens[-5:-1]))
    assert greedy == all(int(ref[p - 1].argmax()) == ids[p] for p in range(len(ids) - 4, len(ids)))
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1


def test_max_tokens_zero_with_echo_only_scores(client, reference, daemon):
    ids, ref = reference
    r = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    (c,) = r.choices
    assert c.text == PROMPT and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(ids)
    # two alternatives a position (fewer keys where two tokens print alike: the legacy shape keys them by text)
    for p in range(1, len(ids)):
        top = c.logprobs.top_logprobs[p]
        best2 = ref[p - 1].topk(2).values.tolist()
        assert 1 <= len(top) <= 2 and all(min(abs(v - b) for b in best2) < 1e-4 for v in top.values())
    assert abs(c.logprobs.token_logprobs[-1] - ref[-2, ids[-1]].item()) < 1e-4
    parts = list(client.completions.create(model="tiny", prompt=[PROMPT, "Hello"], echo=True, logprobs=0,
                                           max_tokens=0, stream=True))
    assert [p.choices[0].text for p in parts] == [PROMPT, "Hello"]
    assert parts[0].choices[0].logprobs.token_logprobs == c.logprobs.token_logprobs
    status, err = daemon.request("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0})
    assert status == 400 and "'max_tokens'" in err["error"]["message"]  # 0 only with echo


def test_streamed_echo_leads_with_the_prompt_logprobs(client, reference):
    ids, _ = reference
    chunks = list(client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=3,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == PROMPT and len(first.logprobs.tokens) == len(ids) and first.logprobs.token_logprobs[0] is None
    gen = [t for ch in chunks[1:] if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    whole = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=1, max_tokens=3, temperature=0)
    assert first.logprobs.tokens + gen == whole.choices[0].logprobs.tokens


def _check_vllm_prompt_logprobs(plps, ids, ref, k):
    """vLLM's shape: None, then per position {id: {logprob, rank, decoded_token}} for the prompt token itself
    and the k most likely there (ranks 1..k)."""
    assert len(plps) == len(ids) and plps[0] is None
    for p in range(1, len(ids)):
        entry = plps[p]
        own = entry[str(ids[p])]
        assert abs(own["logprob"] - ref[p - 1, ids[p]].item()) < 1e-4
        value = ref[p - 1, ids[p]]  # the rank, up to ties within the tolerance
        assert int((ref[p - 1] > value + 1e-4).sum()) + 1 <= own["rank"] <= int((ref[p - 1] > value - 1e-4).sum()) + 1
        values, best = ref[p - 1].topk(k)
        for r, (t, v) in enumerate(zip(best.tolist(), values.tolist()), start=1):
            assert abs(entry[str(t)]["logprob"] - v) < 1e-4
            if t != ids[p]:
                assert entry[str(t)]["rank"] == r
        assert len(entry) in (k, k + 1) and all(isinstance(e["decoded_token"], str) for e in entry.values())


def test_vllm_prompt_logprobs_on_completions_and_chat(client, reference, daemon):
    ids, ref = reference
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0, n=2,
                                  extra_body={"prompt_logprobs": 2})
    assert len(r.choices) == 2
    for c in r.choices:
        _check_vllm_prompt_logprobs(c.model_extra["prompt_logprobs"], ids, ref, 2)
    assert r.choices[0].logprobs is None  # the generated tokens' logprobs are another field
    # with echo and logprobs too: one scoring pass serves both
    both = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1,
                                     extra_body={"prompt_logprobs": 3})
    _check_vllm_prompt_logprobs(both.choices[0].model_extra["prompt_logprobs"], ids, ref, 3)
    assert all(t is None or len(t) == 1 for t in both.choices[0].logprobs.top_logprobs)
    # 0: only the prompt token's own (true, below: one alternative)
    status, body = daemon.request("POST", "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1,
                                                              "prompt_logprobs": 0})
    assert status == 200 and all(len(e) == 1 for e in body["choices"][0]["prompt_logprobs"][1:])
    # chat: the rendered prompt's, on the response
    status, tok = daemon.request("POST", "/tokenize", {"model": "tiny",
                                                       "messages": [{"role": "user", "content": PROMPT}]})
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=1, extra_body={"prompt_logprobs": True})
    plps = chat.model_extra["prompt_logprobs"]
    assert len(plps) == tok["count"] == chat.usage.prompt_tokens and plps[0] is None
    assert all(str(t) in e for t, e in zip(tok["tokens"][1:], plps[1:]))


def test_best_of_answers_the_likeliest_of_its_completions(client):
    """best_of > n: best_of completions a prompt (the seeds n = best_of would draw), of which the n with the
    highest mean logprob per token answer, best first; usage counts every token made; it cannot be streamed."""
    common = dict(model="tiny", prompt=[PROMPT, "Hello, world!"], max_tokens=6, temperature=1.5, seed=11)
    every = client.completions.create(n=4, logprobs=0, **common)
    best = client.completions.create(n=2, best_of=4, **common)
    assert len(best.choices) == 4 and best.choices[0].logprobs is None  # 2 prompts x n 2; no logprobs asked

    def mean(c):
        lps = c.logprobs.token_logprobs
        return sum(lps) / len(lps)
    for p in range(2):
        drawn = every.choices[4 * p:4 * p + 4]
        expected = [c.text for c in sorted(drawn, key=mean, reverse=True)[:2]]
        assert [c.text for c in best.choices[2 * p:2 * p + 2]] == expected
        assert [c.index for c in best.choices[2 * p:2 * p + 2]] == [2 * p, 2 * p + 1]
    assert best.usage.completion_tokens == every.usage.completion_tokens  # all 8 completions' tokens
    assert len({c.text for c in every.choices[:4]}) > 1  # the draws differ, so the choice means something
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(n=2, best_of=4, stream=True, **common)


def test_functions_on_a_template_without_tool_calls_name_the_field_sent(client):
    """The tiny model's template has no tool-call format: the 400 names what the request sent."""
    fn = [{"name": "f", "parameters": {"type": "object", "properties": {}}}]
    with pytest.raises(openai.BadRequestError, match="'functions'"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], functions=fn,
                                       max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="'tools'"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       tools=[{"type": "function", "function": fn[0]}])


def test_llama_cpp_n_cmpl(daemon):
    """/completion's n_cmpl (llama.cpp's; "n" too): each prompt completed that many times, prompt-major, the copies
    drawing with seeds counting up from the request's."""
    body = {"prompt": [PROMPT, "Hello, world!"], "n_predict": 5, "temperature": 1.5, "seed": 5, "n_cmpl": 2}
    status, out = daemon.request("POST", "/completion", body)
    assert status == 200 and [r["index"] for r in out] == [0, 1, 2, 3]
    for k, (prompt, seed) in enumerate([(PROMPT, 5), (PROMPT, 6), ("Hello, world!", 5), ("Hello, world!", 6)]):
        _, one = daemon.request("POST", "/completion", {**body, "prompt": prompt, "seed": seed, "n_cmpl": 1})
        assert out[k]["content"] == one["content"] and out[k]["prompt"] == prompt
    assert out[0]["content"] != out[1]["content"]  # the copies draw differently
    _, by_n = daemon.request("POST", "/completion", {**body, "prompt": PROMPT, "n_cmpl": None, "n": 2})
    assert [r["content"] for r in by_n] == [out[0]["content"], out[1]["content"]]
