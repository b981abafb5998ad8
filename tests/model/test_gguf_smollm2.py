"""The embedded SmolLM2-135M GGUF: greedy tokens identical to transformers
loading the same file (both float32), and batch composition never changes a
sequence's tokens (greedy and seeded sampling)."""

from __future__ import annotations

import pytest
import torch

from flared.model.runner import ModelRunner
from flared.model.sampling import SamplingParams

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the mountains, there lived",
]
NUM_TOKENS = 64


@pytest.fixture(scope="module")
def hf_gguf(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32)
    model.eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def runner(smollm2_source):
    return ModelRunner(smollm2_source.config, smollm2_source.tensors, dtype=torch.float32, num_pages=96,
                       page_tokens=64, max_batch=8, prefill_chunk_tokens=32)


def test_config_from_gguf_metadata(smollm2_source):
    c = smollm2_source.config
    assert smollm2_source.source_kind == "gguf"
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("llama", 30, 576, 9, 3, 64)
    assert c.tie_word_embeddings and "lm_head.weight" not in smollm2_source.tensors
    assert c.rope_theta == 100000.0 and c.vocab_size == 49152


def test_greedy_tokens_match_transformers_gguf(hf_gguf, runner):
    tokenizer, model = hf_gguf
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    params = [SamplingParams(temperature=0, max_tokens=NUM_TOKENS)] * len(prompts)
    ours = runner.generate(prompts, params)
    for text, prompt, result in zip(TEXTS, prompts, ours):
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        assert result.token_ids == expected, f"tokens differ for {text!r}"
        assert result.finish_reason == "length"
        assert result.timings.num_prompt_tokens == len(prompt)


def _eight_prompts(tokenizer_free_ids: list[list[int]]) -> list[list[int]]:
    # Different lengths (5..61 tokens) so prefill chunks and decode steps mix in the batched run.
    base = [t for ids in tokenizer_free_ids for t in ids]
    return [base[i * 7: i * 7 + 5 + 8 * i] for i in range(8)]


@pytest.fixture(scope="module")
def eight_prompts(hf_gguf):
    tokenizer, _ = hf_gguf
    ids = [tokenizer(text)["input_ids"] for text in TEXTS * 6]
    prompts = _eight_prompts(ids)
    assert len({len(p) for p in prompts}) == 8
    return prompts


def test_batched_equals_alone(runner, eight_prompts):
    # Greedy and seeded-sampling requests mixed in one batch: each must get the tokens it gets alone.
    sampled = dict(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, repetition_penalty=1.1,
                   frequency_penalty=0.2, presence_penalty=0.1, max_tokens=16)
    params = [SamplingParams(temperature=0, max_tokens=16) if i % 2 == 0 else SamplingParams(seed=1000 + i, **sampled)
              for i in range(8)]
    batched = runner.generate(eight_prompts, params)
    alone = [runner.generate([p], [sp])[0] for p, sp in zip(eight_prompts, params)]
    for i, (b, a) in enumerate(zip(batched, alone)):
        kind = "greedy" if i % 2 == 0 else "seeded"
        assert b.token_ids == a.token_ids, f"prompt {i} ({kind}) differs between batched and alone"
    assert runner.allocator.num_free == runner.num_pages
    # Another seed must give other draws (guards against a sampler that ignores seeds).
    reseeded = runner.generate(eight_prompts[1:2], [SamplingParams(seed=7, **sampled)])[0]
    assert reseeded.token_ids != batched[1].token_ids
