"""/v1/decisions against a running daemon, checked with an independent forward.

The reference is transformers' LlamaForCausalLM on the same random weights
(the HF checkpoint the tiny core was exported from), run on each whole
prompt+option sequence with no cache: its per-token log-probabilities, their
sums and the softmax over the options must match what the daemon returned.
"""

from __future__ import annotations

import math

import pytest
import torch

MODEL = "tiny"


@pytest.fixture(scope="module")
def reference(tiny_hf_llama):
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_hf_llama, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_hf_llama)
    return model, tok


def _reference_logprobs(model, prompt_ids: list[int], option_ids: list[int]) -> list[float]:
    ids = torch.tensor([prompt_ids + option_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    n = len(prompt_ids)
    return [lp[n + j - 1, t].item() for j, t in enumerate(option_ids)]


def _check(result: dict, model, prompt_ids: list[int], options: list[str]) -> None:
    assert [o["text"] for o in result["options"]] == options
    totals = []
    for o in result["options"]:
        want = _reference_logprobs(model, prompt_ids, o["token_ids"])
        assert o["logprobs"] == pytest.approx(want, abs=2e-4)
        assert o["total_logprob"] == pytest.approx(sum(want), abs=5e-4)
        assert len(o["tokens"]) == len(o["token_ids"])
        totals.append(sum(want))
    top = max(totals)
    z = sum(math.exp(t - top) for t in totals)
    want_p = [math.exp(t - top) / z for t in totals]
    assert [o["probability"] for o in result["options"]] == pytest.approx(want_p, abs=1e-4)
    assert result["chosen"] == max(range(len(totals)), key=lambda i: (totals[i], -i))
    assert math.fsum(o["probability"] for o in result["options"]) == pytest.approx(1.0)


def test_prompt_options_match_full_forward(tiny_daemon, reference):
    model, tok = reference
    prompt = "The quick brown fox jumps over the"
    options = [" lazy dog.", " capital of France", "Hello", " fox", " a + b"]
    status, body = tiny_daemon.request("POST", "/v1/decisions", {"model": MODEL, "prompt": prompt,
                                                                 "options": options})
    assert status == 200, body
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    _check(body, model, prompt_ids, options)
    # The prompt ran once: every option after the first restored it from the prefix cache.
    assert body["usage"]["cached_tokens"] == (len(options) - 1) * len(prompt_ids)


def test_messages_options_match_full_forward(tiny_daemon, reference):
    model, tok = reference
    messages = [{"role": "system", "content": "Answer with one word."},
                {"role": "user", "content": "Is Paris the capital of France?"}]
    options = ["yes", "no", "yes", "maybe not"]  # a duplicate is scored once and reported twice
    status, body = tiny_daemon.request("POST", "/v1/decisions", {"model": MODEL, "messages": messages,
                                                                 "options": options})
    assert status == 200, body
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    _check(body, model, prompt_ids, options)
    assert body["options"][0]["logprobs"] == body["options"][2]["logprobs"]
    # Same request again: identical numbers (deterministic, and a warm cache changes nothing).
    status, again = tiny_daemon.request("POST", "/v1/decisions", {"model": MODEL, "messages": messages,
                                                                  "options": options})
    assert status == 200
    assert [o["logprobs"] for o in again["options"]] == [o["logprobs"] for o in body["options"]]
    assert again["usage"]["cached_tokens"] == 3 * len(prompt_ids)


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "options": ["only one"]}, "options"),
    ({"prompt": "x", "options": ["a"] * 65}, "options"),
    ({"prompt": "x", "options": ["a", ""]}, "options[1]"),
    ({"prompt": "x", "options": ["a", 3]}, "options[1]"),
    ({"options": ["a", "b"]}, "messages"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}], "options": ["a", "b"]}, "messages"),
])
def test_bad_bodies_are_400(tiny_daemon, body, field):
    status, err = tiny_daemon.request("POST", "/v1/decisions", {"model": MODEL, **body})
    assert status == 400
    assert f"'{field}'" in err["error"]["message"]


def test_unknown_model_is_404(tiny_daemon):
    status, _ = tiny_daemon.request("POST", "/v1/decisions", {"model": "nope", "prompt": "x", "options": ["a", "b"]})
    assert status == 404


def test_long_prompt_across_prefill_chunks(tiny_daemon, reference):
    # The tiny core prefills in chunks of 128 tokens: the prompt spans two, so the first option's scores
    # start in a later chunk and the others restore a checkpoint past the first chunk.
    model, tok = reference
    prompt = " ".join(["Paris is the capital of France."] * 14)
    options = [" The quick brown fox jumps over the lazy dog.", " Hello, world!", " def add(a, b):"]
    status, body = tiny_daemon.request("POST", "/v1/decisions", {"model": MODEL, "prompt": prompt,
                                                                 "options": options})
    assert status == 200, body
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert 128 < len(prompt_ids) < 200
    _check(body, model, prompt_ids, options)
    assert body["usage"]["cached_tokens"] == (len(options) - 1) * len(prompt_ids)
