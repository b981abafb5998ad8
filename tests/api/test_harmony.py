"""gpt-oss' harmony format through the daemon: a model scripted (as conftest.py's) to write harmony messages, served
with a harmony chat template, read by the openai, anthropic and ollama SDKs. The analysis channel arrives as
reasoning, a commentary message to functions.get_weather as a tool call, the final channel as the answer; no harmony
marker reaches a client.

The model: after the generation prompt ``<|start|>assistant`` it writes
``<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}`` and stops on ``<|call|>``; after a tool
result the prompt opens the final channel and it writes ``It is sunny in Paris.`` and stops on ``<|return|>``. (Its
tokens join several markers where a marker repeats: its next token depends on the current one only.)"""

from __future__ import annotations

import json

import pytest
from flared_testing.daemon import Daemon
from flared_testing.scripted import bpe_tokenizer, script_successors

TEMPLATE = """\
{%- if tools %}<|start|>developer<|message|># Tools
{% for t in tools %}{{ t.function.name }}: {{ t.function.description }}
{% endfor %}<|end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' %}
{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}
{%- for tc in m.tool_calls or [] %}<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }} \
<|constrain|>json<|message|>{{ tc.function.arguments if tc.function.arguments is string \
else tc.function.arguments | tojson }}<|call|>{% endfor %}
{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}
{%- elif m.role == 'tool' %}<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\
{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% if messages[-1].role == 'tool' %}<|channel|>final<|message|>\
{% endif %}{% endif %}"""

SPECIAL = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>",
           "<|return|>"]
OPEN = "<|channel|>analysis<|message|>"
REASONING = "Need the weather."
TO_CALL = "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
ARGS = ['{"city": ', '"Paris"}']
ANSWER = "It is sunny in Paris."
ADDED = ["assistant", OPEN, REASONING, TO_CALL, *ARGS, ANSWER]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def harmony_daemon(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from flared.core.export import ExportOptions, export_core

    d = tmp_path_factory.mktemp("hf-harmony")
    tok = bpe_tokenizer(d, ["What is the weather in Paris today?", "sunny cloudy celsius"], special=SPECIAL,
                        added=ADDED)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|return|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    ids = {t: tok.token_to_id(t) for t in SPECIAL + ADDED}
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=[ids["<|return|>"], ids["<|call|>"]], bos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    chain = ["assistant", OPEN, REASONING, TO_CALL, *ARGS, "<|call|>"]
    successors = {ids[a]: ids[b] for a, b in zip(chain, chain[1:])}
    successors[ids["<|message|>"]] = ids[ANSWER]
    successors[ids[ANSWER]] = ids["<|return|>"]
    script_successors(model, successors)
    model.save_pretrained(d, safe_serialization=True)
    core = tmp_path_factory.mktemp("cores") / "harmony"
    export_core(d, core, ExportOptions(concurrency=2, context_tokens=1024, prefill_chunk_tokens=256))
    daemon = Daemon(core, tmp_path_factory.mktemp("daemon"))
    yield daemon
    daemon.kill()


def _no_markers(*texts: str | None) -> None:
    for text in texts:
        assert not any(m in (text or "") for m in SPECIAL), text


def test_openai_reasoning_call_and_answer(harmony_daemon):
    import openai

    client = openai.OpenAI(base_url=harmony_daemon.base + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == REASONING
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the call and its result go back through the template, which opens the final channel
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()],
                      "reasoning_content": REASONING},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    r2 = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=40)
    assert r2.choices[0].message.content == ANSWER and r2.choices[0].finish_reason == "stop"
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 10

    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0,
                                                 max_tokens=40, stream=True))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert (reasoning, content) == (REASONING, "")
    assert calls[0].function.name == "get_weather" and json.loads("".join(
        tc.function.arguments or "" for tc in calls)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # without tools the message to the function is the model's text; the markers still never show
    plain = client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=40)
    assert plain.choices[0].message.model_extra["reasoning_content"] == REASONING
    assert plain.choices[0].message.content == '{"city": "Paris"}'
    _no_markers(plain.choices[0].message.content, r2.choices[0].message.content)


def test_anthropic_thinking_and_tool_use(harmony_daemon):
    import anthropic

    client = anthropic.Anthropic(base_url=harmony_daemon.base, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "description": "Current weather in a city",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    m = client.messages.create(model="tiny", max_tokens=40, messages=ASK, tools=tools)
    kinds = [b.type for b in m.content]
    assert kinds == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[0].thinking == REASONING and m.content[1].input == {"city": "Paris"}


def test_ollama_thinking_and_tool_calls(harmony_daemon):
    import ollama

    client = ollama.Client(host=harmony_daemon.base)
    r = client.chat(model="tiny", messages=ASK, tools=TOOLS, think=True, options={"temperature": 0})
    assert r.message.thinking == REASONING
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and dict(call.function.arguments) == {"city": "Paris"}
    _no_markers(r.message.content)
