"""A tool-calling model for the API tests, and one `flared run` daemon serving it.

The model is a tiny Llama whose weights were set by hand so that its greedy
output is a known function of the last prompt token (every layer's output
projections are zero, so the logits depend on the current token only, and the
LM head maps a few tokens to chosen successors). The tokenizer carries the
Hermes/Qwen markers as added tokens and the chat template is a Qwen-style
template with tools and ``enable_thinking``. So, at temperature 0:

- after the generation prompt (``<|im_start|>assistant\\n``) the model writes
  ``<think>Let me check the weather.</think><tool_call>{"name": "get_weather",
  "arguments": {"city": "Paris"}}</tool_call>`` and stops;
- with thinking disabled (the prompt ends ``<think>\\n\\n</think>\\n\\n``) it
  writes ``It is sunny in Paris.`` and stops;
- after `` la`` it writes `` la`` until max_tokens (long streams, cancellation);
- with ``open_think`` the prompt itself opens ``<think>\\n`` (as DeepSeek-R1's
  does): the output starts inside the reasoning (and repeats the opener).

That is real generation through the daemon, detokenizer, parsers and
templates; only the weights are chosen rather than trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flared_testing.daemon import Daemon
from flared_testing.scripted import bpe_tokenizer, script_successors

TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m['role'] == 'system' %}
{%- elif m['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ m['content'] }}
</tool_response><|im_end|>
{% elif m['role'] == 'assistant' %}<|im_start|>assistant
{% if m['content'] %}{{ m['content'] }}{% endif %}
{%- if m['tool_calls'] %}{% for tc in m['tool_calls'] %}
<tool_call>
{"name": "{{ tc['function']['name'] }}", "arguments": {{ tc['function']['arguments'] | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% else %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif open_think is defined and open_think %}<think>
{% endif %}{% endif %}"""

REASONING = "Let me check the weather."
CALL_PIECES = ['{"name": "get_weather", "arguments": ', '{"city": ', '"Paris"}}']
ANSWER = "It is sunny in Paris."
LOOP = " la"  # follows itself: a prompt ending in it generates until max_tokens
ADDED = ["\n\n", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
         REASONING, *CALL_PIECES, ANSWER, LOOP]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
          "What is the weather in Paris today?", "Hello, world! How are you today?"]


def _train_tokenizer(directory: Path):
    return bpe_tokenizer(directory, CORPUS, special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], added=ADDED)


@pytest.fixture(scope="session")
def tool_hf_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("hf-tools")
    tok = _train_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": TOOL_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    ids = {t: tok.token_to_id(t) for t in ADDED}
    newline = tok.encode("assistant\n").ids[-1]
    chain = [newline, ids["<think>"], ids[REASONING], ids["</think>"], ids["<tool_call>"],
             *(ids[p] for p in CALL_PIECES), ids["</tool_call>"], 2]
    successors = dict(zip(chain, chain[1:]))
    successors[ids["\n\n"]] = ids[ANSWER]
    successors[ids[ANSWER]] = 2
    successors[ids[LOOP]] = ids[LOOP]
    script_successors(model, successors)
    model.save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="session")
def tool_core(tool_hf_dir, tmp_path_factory) -> Path:
    from flared.core.export import ExportOptions, export_core

    out = tmp_path_factory.mktemp("cores") / "tools"
    export_core(tool_hf_dir, out, ExportOptions(concurrency=4, context_tokens=1024, prefill_chunk_tokens=256))
    return out


@pytest.fixture(scope="session")
def daemon(tool_core, tmp_path_factory):
    d = Daemon(tool_core, tmp_path_factory.mktemp("daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def tiny_core_daemon(tiny_core, tmp_path_factory):
    """A daemon serving the random-weight tiny Llama (tests/conftest.py's tiny_core), whose outputs are compared
    with transformers' on the same weights; one per module, stopped after it (no daemon idles through the
    rest of the suite)."""
    d = Daemon(tiny_core, tmp_path_factory.mktemp("tiny-core"))
    yield d
    d.kill()


@pytest.fixture(scope="session")
def token_ids(tool_hf_dir) -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tool_hf_dir / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in ADDED}
