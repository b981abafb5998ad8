"""Fill in the middle: OpenAI completions' suffix, Ollama's suffix and llama.cpp's /infill on a tiny
random-weight Llama whose tokenizer has Qwen-style FIM tokens. Each route must run exactly the prompt
<|fim_prefix|>prefix<|fim_suffix|>suffix<|fim_middle|>: the same tokens and greedy text as that prompt sent
as text. A model without FIM tokens answers 400."""

from __future__ import annotations

import json

import ollama
import openai
import pytest

PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nprint(add(1, 2))\n"
FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"]


@pytest.fixture(scope="module")
def fim_daemon(tmp_path_factory):
    import torch
    from flared_testing.daemon import Daemon
    from flared_testing.scripted import bpe_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from flared.core.export import ExportOptions, export_core

    d = tmp_path_factory.mktemp("hf-fim")
    tok = bpe_tokenizer(d, [PREFIX + SUFFIX, "def mul(x, y):\n    return x * y\n"],
                        special=["<|endoftext|>", *FIM_TOKENS], vocab_size=400)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                         "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=0, bos_token_id=None)
    LlamaForCausalLM(cfg).eval().save_pretrained(d, safe_serialization=True)
    core = tmp_path_factory.mktemp("cores") / "fim"
    export_core(d, core, ExportOptions(concurrency=2, context_tokens=256, prefill_chunk_tokens=128))
    daemon = Daemon(core, tmp_path_factory.mktemp("fim-run"))
    yield daemon
    daemon.kill()


def test_fim_tokens_and_prompt_layout():
    from tokenizers import Tokenizer, models

    from flared.frontend.fim import fim_prompt, fim_tokens

    def tokenizer(names):
        t = Tokenizer(models.WordLevel({"x": 0}, unk_token="x"))
        t.add_special_tokens(names)
        return t
    qwen = fim_tokens(tokenizer(FIM_TOKENS))
    assert (qwen.prefix, qwen.suffix, qwen.middle, qwen.file_sep) == (1, 2, 3, 4) and qwen.ends == {4}
    full = fim_tokens(tokenizer([*FIM_TOKENS, "<|fim_pad|>", "<|repo_name|>"]))
    assert full.ends == {4, 5, 6}  # llama.cpp's end-of-generation tokens for FIM models
    star = fim_tokens(tokenizer(["<fim_prefix>", "<fim_middle>", "<fim_suffix>"]))
    assert (star.prefix, star.suffix, star.middle, star.file_sep) == (1, 3, 2, None)
    assert fim_tokens(tokenizer(["<fim_prefix>", "<fim_suffix>"])) is None  # no middle: not a FIM model
    enc = lambda text: [ord(c) for c in text]  # noqa: E731
    assert fim_prompt(qwen, enc, "a", "b", extra=[("f.py", "c")], bos=[9]) == [9, 4, *enc("f.py\nc"), 1, 97, 2, 98, 3]
    assert fim_prompt(star, enc, "a", "b", extra=[("f.py", "c")]) == [*enc("c\n"), 1, 97, 3, 98, 2]


def test_each_route_runs_the_fim_prompt(fim_daemon):
    client = openai.OpenAI(base_url=fim_daemon.base + "/v1", api_key="unused", max_retries=0)
    as_text = "<|fim_prefix|>" + PREFIX + "<|fim_suffix|>" + SUFFIX + "<|fim_middle|>"
    ref = client.completions.create(model="tiny", prompt=as_text, max_tokens=12, temperature=0)
    fim = client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0)
    # the same tokens as the prompt sent as text; the fill stops where this random model writes <|file_sep|>, a
    # token that ends a fill (test_a_fill_stops_at_the_model_s_fim_end_tokens), which the plain prompt runs past
    assert fim.usage.prompt_tokens == ref.usage.prompt_tokens and ref.choices[0].text.startswith(fim.choices[0].text)
    assert fim.choices[0].text and fim.choices[0].finish_reason == "stop"  # the random model writes something
    oc = ollama.Client(host=fim_daemon.base)
    assert oc.show("tiny").capabilities == ["completion", "insert"]  # what editors check before sending a suffix
    o = oc.generate(model="tiny", prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 12})
    assert o.response == fim.choices[0].text and o.prompt_eval_count == ref.usage.prompt_tokens
    status, inf = fim_daemon.request("POST", "/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX,
                                                         "n_predict": 12, "temperature": 0})
    assert status == 200 and inf["content"] == fim.choices[0].text
    assert inf["tokens_evaluated"] == ref.usage.prompt_tokens
    status, extra = fim_daemon.request("POST", "/infill", {
        "input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4, "temperature": 0,
        "input_extra": [{"filename": "util.py", "text": "def mul(x, y):\n    return x * y\n"}]})
    _, sep = fim_daemon.request("POST", "/tokenize", {"content": "util.py\ndef mul(x, y):\n    return x * y\n"})
    assert status == 200 and extra["tokens_evaluated"] == ref.usage.prompt_tokens + 1 + sep["count"]


def test_a_model_without_fim_tokens_says_so(daemon):
    status, err = daemon.request("POST", "/v1/completions", {"model": "tiny", "prompt": "a", "suffix": "b"})
    assert status == 400 and err["error"]["param"] == "suffix" and "no fill-in-the-middle tokens" in \
        err["error"]["message"]
    status, err = daemon.request("POST", "/infill", {"input_prefix": "a", "input_suffix": "b"})
    assert status == 400 and "no fill-in-the-middle tokens" in err["error"]["message"]
    status, err = daemon.request("POST", "/v1/completions", {"model": "tiny", "prompt": [1, 2], "suffix": "b"})
    assert status == 400 and "needs text prompts" in err["error"]["message"]


def test_llama_vim_s_request(fim_daemon):
    """llama.vim's /infill body as it sends it: llama.cpp's infill sampler after top-k and top-p, n_indent,
    the time limits, and response_fields, which answers those paths only, each under its path."""
    fields = ["content", "timings/prompt_n", "timings/predicted_n", "timings/predicted_ms", "truncated",
              "tokens_cached", "timings/no_such"]
    body = {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [], "prompt": "",
            "n_predict": 8, "n_indent": 4, "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"],
            "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": fields}
    status, out = fim_daemon.request("POST", "/infill", body)
    assert status == 200, out
    assert set(out) == set(fields) - {"timings/no_such"} and isinstance(out["content"], str)
    assert out["timings/prompt_n"] + out["tokens_cached"] > 0 and 0 < out["timings/predicted_n"] <= 8, out
    assert out["truncated"] is False
    status, letters = fim_daemon.request("POST", "/infill", {**body, "samplers": "kpi", "response_fields": []})
    assert status == 200 and letters["generation_settings"]["samplers"] == ["top_k", "top_p", "infill"]
    status, err = fim_daemon.request("POST", "/infill", {**body, "response_fields": "content"})
    assert status == 400 and "'response_fields'" in err["error"]["message"]


def test_a_fill_stops_at_the_model_s_fim_end_tokens(fim_daemon):
    """The file separator (and the pad and repository tokens, where a model has them) end a fill, as llama.cpp
    counts them end-of-generation for FIM models: forced by logit_bias, /infill and a completion with a suffix stop
    at once; the same prompt as plain /completion tokens runs on."""
    sep = 4  # <|file_sep|> in this tokenizer
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 6, "temperature": 0, "return_tokens": True,
            "logit_bias": [[sep, 100.0]]}
    status, fill = fim_daemon.request("POST", "/infill", body)
    assert status == 200 and fill["tokens_predicted"] == 1 and fill["stop_type"] == "eos", fill
    _, as_tokens = fim_daemon.request("POST", "/tokenize", {"content": "<|fim_prefix|>" + PREFIX + "<|fim_suffix|>"
                                                            + SUFFIX + "<|fim_middle|>", "add_special": False})
    status, plain = fim_daemon.request("POST", "/completion", {**body, "prompt": as_tokens["tokens"]})
    assert status == 200 and plain["tokens_predicted"] == 6 and plain["tokens"] == [sep] * 6
    status, oai = fim_daemon.request("POST", "/v1/completions", {"model": "tiny", "prompt": PREFIX, "suffix": SUFFIX,
                                                                 "max_tokens": 6, "temperature": 0,
                                                                 "logit_bias": {str(sep): 100}})
    assert status == 200 and oai["usage"]["completion_tokens"] == 1 and oai["choices"][0]["finish_reason"] == "stop"
